"""What writing one large non-streamed reply costs the server's event loop (CPU, demo model).

    python benchmarks/bench_reply_json.py [--tree DIR ...] [--prompt-tokens 4000] [--tokens 300] [--top 20]

A non-streamed OpenAI reply with top logprobs is megabytes of JSON, written on the event loop that
serves every client. Per tree (`--tree`: a checkout whose `rxf` is imported instead of this one's,
e.g. a `git worktree` of the previous commit; default this tree), a demo server is started and sent,
after one small request of each kind (the first calls' imports), one at a time, while /health is
probed every 10 ms (`rxf.testing.HealthProbe`):
  completions   /v1/completions, `echo` with `logprobs` `--top` over a prompt of `--prompt-tokens`
                tokens and one new token (the prompt's logprobs: one prefill, no long decode)
  chat          /v1/chat/completions, `--tokens` greedy tokens with `top_logprobs` `--top`
  responses     /v1/responses, the same with its output logprobs, stored; then
  retrieve      GET /v1/responses/{id} of it
For each: wall seconds, reply MB, /health's slowest answer during it (the event loop's longest
hold, plus the machine's own noise: an idle second's slowest answer is printed too) and the
server's HTTP process's CPU seconds (answering the probe's ~100 /health requests a second is most of
them: ~0.1 s a second). One table; a tree's figures come from one server, the trees'
from one invocation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from bench_stream_logprobs import REPO, demo_server  # noqa: E402

from rxf.testing.health_probe import HealthProbe  # noqa: E402

WORDS = "The history of the city begins with a small settlement by the river, where traders met. "


def requests(prompt_tokens: int, tokens: int, top: int) -> dict[str, Callable[[httpx.Client], httpx.Response]]:
    prompt = WORDS * (prompt_tokens // 18)  # ~18 tokens a sentence in SmolLM2's tokenizer
    greedy = {"model": "demo", "temperature": 0, "ignore_eos": True}
    chat = [{"role": "user", "content": "Tell me about the history of the city."}]
    stored: dict[str, str] = {}

    def responses(c: httpx.Client) -> httpx.Response:
        r = c.post("/v1/responses", json={
            "model": "demo", "input": chat, "temperature": 0, "max_output_tokens": tokens, "top_logprobs": top,
            "include": ["message.output_text.logprobs"], "store": True})
        stored["id"] = r.json()["id"]
        return r

    return {
        "completions": lambda c: c.post("/v1/completions", json={
            **greedy, "prompt": prompt, "echo": True, "logprobs": top, "max_tokens": 1}),
        "chat": lambda c: c.post("/v1/chat/completions", json={
            **greedy, "messages": chat, "max_tokens": tokens, "logprobs": True, "top_logprobs": top}),
        "responses": responses,
        "retrieve": lambda c: c.get(f"/v1/responses/{stored['id']}"),
    }


def measure(tree: Path, args: argparse.Namespace, work: Path) -> dict[str, dict[str, float]]:
    server = demo_server(tree, work)
    try:
        http = psutil.Process(server.proc.pid)
        with HealthProbe(server.url) as idle:
            time.sleep(1)
        rows = {"idle": {"health_ms": idle.max_latency_s() * 1000}}
        with httpx.Client(base_url=server.url, timeout=900) as client:
            for send in requests(40, 4, args.top).values():  # warm-up: first calls' imports
                send(client).raise_for_status()
            for name, send in requests(args.prompt_tokens, args.tokens, args.top).items():
                cpu = sum(http.cpu_times()[:2])
                start = time.perf_counter()
                with HealthProbe(server.url) as probe:
                    r = send(client)
                wall = time.perf_counter() - start
                r.raise_for_status()
                rows[name] = {"s": wall, "mb": len(r.content) / 1e6, "health_ms": probe.max_latency_s() * 1000,
                              "http_cpu_s": sum(http.cpu_times()[:2]) - cpu}
        return rows
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, action="append", default=None, help="a checkout to import rxf from")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    with tempfile.TemporaryDirectory() as tmp:
        results = {tree: measure(tree, args, Path(tmp)) for tree in trees}
    print(f"prompt {args.prompt_tokens} tokens (completions), {args.tokens} new tokens (chat, responses), top {args.top}")
    print("| tree | request | s | reply MB | /health slowest ms | HTTP process CPU s |")
    print("|---|---|---|---|---|---|")
    for tree, rows in results.items():
        for name, r in rows.items():
            if name == "idle":
                print(f"| {tree} | (idle, 1 s) | | | {r['health_ms']:.0f} | |")
            else:
                print(f"| {tree} | {name} | {r['s']:.2f} | {r['mb']:.2f} | {r['health_ms']:.0f} | {r['http_cpu_s']:.2f} |")


if __name__ == "__main__":
    main()
