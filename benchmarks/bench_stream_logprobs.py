"""What one client's streamed `/generate` with top logprobs costs the server and its neighbours (CPU, demo model).

    python benchmarks/bench_stream_logprobs.py [--tree DIR ...] [--tokens 1000] [--top 20]

Native streams are cumulative (SGLang's chunks): every chunk carries the whole output so far, its
logprob lists included, so the bytes of a stream grow with the square of its length. Per tree
(`--tree`: a checkout whose `rxf` is imported instead of this one's, e.g. a `git worktree` of the
previous commit; default this tree), a demo server is started and measured, in this order:
  alone      a greedy 100-token /v1/completions request (the neighbour), by itself
  stream     the stream of `--tokens` tokens with `--top` top logprobs: wall time, bytes received,
             and the CPU seconds the server's HTTP process (the event loop that serialises every
             client's chunks) spent during it
  together   the neighbour again while the stream runs (started 2 s into it)
Prints one table; a tree's figures come from one server, the trees' from one invocation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from compare_cpu import Server, free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NEIGHBOUR = {"model": "demo", "prompt": "The history of the city", "max_tokens": 100, "temperature": 0,
             "ignore_eos": True}


def neighbour_s(url: str) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=NEIGHBOUR, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


def stream(url: str, tokens: int, top: int, out: dict[str, float]) -> None:
    body = {"text": "Once", "stream": True, "return_logprob": True, "top_logprobs_num": top,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    received, start = 0, time.perf_counter()
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as r:
        for chunk in r.iter_bytes():
            received += len(chunk)
    out.update(stream_s=time.perf_counter() - start, stream_mb=received / 1e6)


def demo_server(tree: Path, work: Path) -> Server:
    """The demo server importing rxf from `tree`, ready (stop it when done)."""
    port = free_port()
    cmd = [sys.executable, "-m", "rxf.entrypoints.cli", "launch", str(REPO / "examples" / "demo.toml"), "--port", str(port)]
    env = os.environ | {"PYTHONPATH": str(tree)}
    here = Path.cwd()
    os.chdir(tree)  # `python -m` puts the working directory first on sys.path: the server's, inherited
    try:
        server = Server(tree.name, cmd, env, work / f"{tree.name}.log", "/health")
    finally:
        os.chdir(here)
    error = server.wait_ready()
    if error:
        server.stop()
        raise RuntimeError(f"{tree}: {error}")
    return server


def measure(tree: Path, tokens: int, top: int, work: Path) -> dict[str, float]:
    server = demo_server(tree, work)
    try:
        procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
        neighbour_s(server.url)  # warm-up
        out = {"alone_s": neighbour_s(server.url)}
        cpu = [sum(p.cpu_times()[:2]) for p in procs]
        streamer = threading.Thread(target=stream, args=(server.url, tokens, top, out))
        streamer.start()
        time.sleep(2)
        out["together_s"] = neighbour_s(server.url)
        streamer.join()
        print(f"{tree}: rxf from {procs[0].cwd()}; CPU s of each process during the stream: " + ", ".join(
            f"{'HTTP' if p is procs[0] else p.cmdline()[-1]} {sum(p.cpu_times()[:2]) - before:.1f}"
            for p, before in zip(procs, cpu, strict=True)))
        out["http_cpu_s"] = sum(procs[0].cpu_times()[:2]) - cpu[0]
        return out
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, action="append", default=None, help="a checkout to import rxf from")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    with tempfile.TemporaryDirectory() as tmp:
        rows = {tree: measure(tree, args.tokens, args.top, Path(tmp)) for tree in trees}
    print(f"| tree | stream of {args.tokens} tokens, top {args.top}: s | MB received | HTTP process CPU s "
          f"| neighbour alone s | neighbour beside the stream s |")
    print("|---|---|---|---|---|---|")
    for tree, r in rows.items():
        print(f"| {tree} | {r['stream_s']:.1f} | {r['stream_mb']:.1f} | {r['http_cpu_s']:.1f} | {r['alone_s']:.2f} "
              f"| {r['together_s']:.2f} |")


if __name__ == "__main__":
    main()
