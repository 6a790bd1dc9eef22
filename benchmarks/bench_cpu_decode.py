"""CPU decode benchmark: rxf's `Runtime` against Hugging Face `generate` on the same checkpoint.

    RXF_CACHE_DIR=/tmp/rxfcache python benchmarks/bench_cpu_decode.py \
        [--config examples/demo.toml] [--output results.json] [--repeats 3] [--cold]

Phases run one after the other, never two models computing at once:
  cold  (only with --cold) `Runtime.from_config` in a subprocess whose RXF_CACHE_DIR is a fresh
        empty directory: fetching and converting the demo model, then starting the engine.
  rxf   `Runtime.from_config` with the model already prepared (--load-repeats times), then greedy
        decode of N new tokens: 1 request (plain and streamed), and B concurrent requests.
  hf    `AutoModelForCausalLM.generate` (fp32, CPU, do_sample=False, min_new_tokens=N) on the same
        checkpoint directory and the same prompt token ids: batch 1 and batch B (left padding).

Every timed call is repeated; the report gives the median and the min/max. rxf's radix cache is
flushed before each timed call, so no repeat reuses an earlier repeat's prompt KV. The HF phase uses
the torch thread count that rxf's scheduler reports, so both compute with the same number of threads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Chat-style user turns; with the demo model's chat template (system turn included) each prompt is
# 30-60 tokens.
USER_TURNS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while working from home.",
    "Explain in simple terms why the sky looks blue during the day.",
    "Write a short poem about a cat sleeping in the sun.",
    "How do I boil an egg so that the yolk stays soft?",
    "What are the main differences between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Can you suggest a healthy breakfast that takes less than ten minutes to prepare?",
    "Why do leaves change colour in autumn, and which chemicals are involved?",
    "I have a job interview tomorrow for a junior developer position. What should I prepare?",
    "Translate the sentence 'Where is the train station?' into Spanish and explain the grammar.",
    "What is the difference between weather and climate? Please give an example of each.",
    "Describe how a bicycle gear system works to someone who has never ridden a bike.",
    "List some good habits for keeping a houseplant alive, especially for beginners who travel a lot.",
    "My sourdough bread comes out flat and dense every time. What could I be doing wrong?",
    "Plan a relaxing one-day itinerary for a visitor in Kyoto who likes gardens and tea.",
]


# ---------------------------------------------------------------- helpers
def summarize(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    cpu_model, cores = "unknown", os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu_model": cpu_model, "logical_cpus": cores, "mem_total_gib": mem_gib, "platform": platform.platform()}


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def chat_prompt_ids(tokenizer: Any) -> list[list[int]]:
    """The token ids of every user turn rendered with the model's chat template."""
    out = []
    for turn in USER_TURNS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


# ---------------------------------------------------------------- cold start (subprocess)
def phase_cold(config: str) -> dict[str, Any]:
    """Run in a subprocess with RXF_CACHE_DIR pointing at an empty directory."""
    from rxf import Runtime

    load_before = loadavg()
    start = time.perf_counter()
    rt = Runtime.from_config(config)
    elapsed = time.perf_counter() - start
    info = dict(rt.engine.info)
    rt.shutdown()
    return {"from_config_s": elapsed, "engine_load_time_s": info.get("load_time_s"), "loadavg_before": load_before}


def run_cold(config: str) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="rxf-bench-cold-")
    try:
        env = dict(os.environ, RXF_CACHE_DIR=tmp)
        cmd = [sys.executable, __file__, "--config", config, "--_cold-child"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cold phase failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- rxf
def phase_rxf(config: str, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from rxf import Runtime

    n, batch = args.new_tokens, prompts[: args.batch]
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    res: dict[str, Any] = {"loadavg_before": loadavg()}

    load_times, engine_load_times = [], []
    rt = None
    for i in range(args.load_repeats):
        start = time.perf_counter()
        rt = Runtime.from_config(config)
        load_times.append(time.perf_counter() - start)
        engine_load_times.append(rt.engine.info["load_time_s"])
        if i + 1 < args.load_repeats:
            rt.shutdown()
    assert rt is not None
    res["load_s"] = summarize(load_times)
    res["engine_load_time_s"] = summarize(engine_load_times)
    res["engine_info"] = {k: v for k, v in rt.engine.info.items() if k != "model_path"}
    res["torch_threads"] = rt.engine.info["torch_threads"]
    print(f"[rxf] scheduler torch threads: {res['torch_threads']}", flush=True)
    try:
        # Warm-up (untimed): one short request and one short batch.
        rt.generate(input_ids=batch[0], sampling_params={**params, "max_new_tokens": 8})
        rt.generate(input_ids=batch, sampling_params={**params, "max_new_tokens": 8})

        times, tokens = [], []
        for _ in range(args.repeats):
            rt.flush_cache()
            start = time.perf_counter()
            out = rt.generate(input_ids=batch[0], sampling_params=params)
            times.append(time.perf_counter() - start)
            tokens.append(out["meta_info"]["completion_tokens"])
        res["bs1_output_ids"] = out["output_ids"]
        res["bs1"] = _throughput(times, tokens)

        ttfts, decode_rates, stream_tokens = [], [], []
        for _ in range(args.repeats):
            rt.flush_cache()
            start = time.perf_counter()
            first = None
            count = 0
            for chunk in rt.generate(input_ids=batch[0], sampling_params=params, stream=True):
                if chunk["output_ids"] and first is None:
                    first, first_count = time.perf_counter(), len(chunk["output_ids"])
                count += len(chunk["output_ids"])
            end = time.perf_counter()
            ttfts.append(first - start)
            decode_rates.append((count - first_count) / (end - first))
            stream_tokens.append(count)
        res["bs1_stream"] = {
            "ttft_s": summarize(ttfts),
            "decode_tok_s": summarize(decode_rates),
            "tokens": stream_tokens,
        }

        times, tokens, cached = [], [], []
        for _ in range(args.repeats):
            rt.flush_cache()
            start = time.perf_counter()
            outs = rt.generate(input_ids=batch, sampling_params=params)
            times.append(time.perf_counter() - start)
            tokens.append(sum(o["meta_info"]["completion_tokens"] for o in outs))
            cached.append(sum(o["meta_info"]["cached_tokens"] for o in outs))
        res["batch_output_ids"] = [o["output_ids"] for o in outs]
        res["batch"] = _throughput(times, tokens) | {"cached_prompt_tokens": cached}
    finally:
        rt.shutdown()
    res["loadavg_after"] = loadavg()
    return res


def _throughput(times: list[float], tokens: list[int]) -> dict[str, Any]:
    return {
        "wall_s": summarize(times),
        "output_tok_s": summarize([t / s for t, s in zip(tokens, times, strict=True)]),
        "tokens": tokens,
    }


# ---------------------------------------------------------------- Hugging Face
def phase_hf(model_path: str, prompts: list[list[int]], threads: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    res: dict[str, Any] = {"loadavg_before": loadavg(), "torch_threads": torch.get_num_threads()}
    print(f"[hf] torch threads: {res['torch_threads']}", flush=True)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    res["load_s"] = time.perf_counter() - start
    n, batch = args.new_tokens, prompts[: args.batch]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id

    def inputs(rows: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}

    class FirstTokenTimer(BaseStreamer):
        """generate() calls put() with the prompt first, then once per generated step."""

        def __init__(self) -> None:
            self.calls = 0
            self.first: float | None = None

        def put(self, value: Any) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def generate(rows: list[list[int]], new_tokens: int, streamer: Any = None) -> torch.Tensor:
        enc = inputs(rows)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                streamer=streamer,
            )
        return out[:, enc["input_ids"].shape[1] :]

    generate([batch[0]], 8)  # warm-up (untimed)
    generate(batch, 8)

    times, tokens, ttfts, decode_rates = [], [], [], []
    for _ in range(args.repeats):
        timer = FirstTokenTimer()
        start = time.perf_counter()
        out = generate([batch[0]], n, streamer=timer)
        end = time.perf_counter()
        times.append(end - start)
        tokens.append(int(out.numel()))
        ttfts.append(timer.first - start)
        decode_rates.append((out.numel() - 1) / (end - timer.first))
    res["bs1_output_ids"] = out[0].tolist()
    res["bs1"] = _throughput(times, tokens)
    res["bs1_stream"] = {"ttft_s": summarize(ttfts), "decode_tok_s": summarize(decode_rates)}

    times, tokens = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = generate(batch, n)
        times.append(time.perf_counter() - start)
        tokens.append(int(out.numel()))
    res["batch_output_ids"] = out.tolist()
    res["batch"] = _throughput(times, tokens)
    res["loadavg_after"] = loadavg()
    del model
    return res


# ---------------------------------------------------------------- report
def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two greedy continuations."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def fmt(s: dict[str, Any], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def report(results: dict[str, Any]) -> str:
    r, h, b = results["rxf"], results["hf"], results["settings"]["batch"]
    lines = [
        "| metric | rxf | HF transformers | rxf / HF |",
        "|---|---|---|---|",
    ]

    def row(name: str, rs: dict[str, Any], hs: dict[str, Any], digits: int = 1, higher_better: bool = True) -> None:
        ratio = rs["median"] / hs["median"]
        lines.append(f"| {name} | {fmt(rs, digits)} | {fmt(hs, digits)} | {ratio:.2f} |")

    row("1 request: output tok/s", r["bs1"]["output_tok_s"], h["bs1"]["output_tok_s"])
    row("1 request: wall s", r["bs1"]["wall_s"], h["bs1"]["wall_s"], 2)
    row("1 request: TTFT s", r["bs1_stream"]["ttft_s"], h["bs1_stream"]["ttft_s"], 3)
    row("1 request: decode-only tok/s", r["bs1_stream"]["decode_tok_s"], h["bs1_stream"]["decode_tok_s"])
    row(f"{b} requests: output tok/s", r["batch"]["output_tok_s"], h["batch"]["output_tok_s"])
    row(f"{b} requests: wall s", r["batch"]["wall_s"], h["batch"]["wall_s"], 2)
    lines.append("")
    lines.append(f"rxf load (warm cache) s: {fmt(r['load_s'], 2)}; HF from_pretrained s: {h['load_s']:.2f}")
    if "cold" in results:
        c = results["cold"]
        lines.append(f"first use (cold cache) from_config s: {c['from_config_s']:.2f}")
    lines.append(f"torch threads: rxf scheduler {r['torch_threads']}, HF {h['torch_threads']}")
    agree = results["agreement"]
    lines.append(
        f"greedy agreement (common prefix, tokens): 1 request {agree['bs1']}/{b and results['settings']['new_tokens']}; "
        f"{b} requests min {min(agree['batch'])}, median {statistics.median(agree['batch'])}"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/demo.toml")
    ap.add_argument("--output", default=None, help="write every measurement as JSON here")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement")
    ap.add_argument("--load-repeats", type=int, default=3, help="warm-cache engine starts to time")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="concurrent requests (at most 16)")
    ap.add_argument("--cold", action="store_true", help="also time one first-use start with an empty cache")
    ap.add_argument("--skip-hf", action="store_true", help="rxf only (no reference)")
    ap.add_argument("--_cold-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._cold_child:
        print(json.dumps(phase_cold(args.config)))
        return
    if not 1 <= args.batch <= len(USER_TURNS):
        ap.error(f"--batch must be in [1, {len(USER_TURNS)}]")

    from transformers import AutoTokenizer

    from rxf.core.config import load_config
    from rxf.entrypoints.demo_model import resolve_model_path

    results: dict[str, Any] = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": git_commit(),
        "machine": machine_info(),
        "settings": {
            "config": args.config,
            "repeats": args.repeats,
            "new_tokens": args.new_tokens,
            "batch": args.batch,
            "rxf_cache_dir": os.environ.get("RXF_CACHE_DIR"),
        },
    }
    if args.cold:
        print("[cold] first-use start with an empty cache ...", flush=True)
        results["cold"] = run_cold(args.config)
        print(f"[cold] {results['cold']['from_config_s']:.2f} s", flush=True)

    model_path = resolve_model_path(load_config(args.config).model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = chat_prompt_ids(tokenizer)
    results["settings"]["prompt_tokens"] = [len(p) for p in prompts[: args.batch]]

    print("[rxf] ...", flush=True)
    results["rxf"] = phase_rxf(args.config, prompts, args)
    print(f"[rxf] 1 request {fmt(results['rxf']['bs1']['output_tok_s'])} tok/s; "
          f"{args.batch} requests {fmt(results['rxf']['batch']['output_tok_s'])} tok/s", flush=True)
    if not args.skip_hf:
        print("[hf] ...", flush=True)
        results["hf"] = phase_hf(model_path, prompts, results["rxf"]["torch_threads"], args)
        results["agreement"] = {
            "bs1": agreement(results["rxf"]["bs1_output_ids"], results["hf"]["bs1_output_ids"]),
            "batch": [
                agreement(a, b)
                for a, b in zip(results["rxf"]["batch_output_ids"], results["hf"]["batch_output_ids"], strict=True)
            ],
        }
        print(report(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
