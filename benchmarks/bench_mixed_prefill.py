"""Streams during a long prefill: the longest inter-token gap of running streams while a long prompt
prefills, with mixed chunked prefill on and off and several chunk sizes (demo model, CPU).

    python benchmarks/bench_mixed_prefill.py [--config examples/demo.toml] [--streams 8]
        [--prompt-tokens 4000] [--chunks 256,512,1024] [--rounds 2] [--output results.json]

Per setting: `--streams` greedy streams start and run until each has streamed a few tokens; then one
request with a `--prompt-tokens` prompt (1 new token) is sent. Reported: the long request's time to
first token (its prefill), and over the streams, the longest gap between two consecutive chunks while
that prefill ran, and the streams' decode rate over the same window. "off" is the old behaviour:
the whole prompt in one forward (no chunking), during which nothing else runs; "separate" chunks
the prompt but runs its chunks as forwards of their own between decode steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

from rxf import Runtime

SETTINGS_HELP = "chunk sizes for the mixed and separate settings"


async def one_setting(rt: Runtime, streams: int, prompt_tokens: int, vocab: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    params = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    started = asyncio.Event()
    stop = asyncio.Event()

    async def stream(i: int) -> None:
        prompt = [rng.randrange(100, vocab) for _ in range(40)]
        agen = await rt.async_generate(input_ids=prompt, sampling_params=params, stream=True)
        async for _ in agen:
            arrivals[i].append(time.perf_counter())
            if all(len(a) >= 4 for a in arrivals):
                started.set()
            if stop.is_set():
                break
        await agen.aclose()

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    await started.wait()
    await asyncio.sleep(0.5)  # steady decoding before the long prompt arrives
    long_prompt = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]
    t0 = time.perf_counter()
    await rt.async_generate(input_ids=long_prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
    t1 = time.perf_counter()
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*tasks)
    gaps, tokens = [], 0
    for times in arrivals:
        inside = [t for t in times if t0 <= t <= t1]
        window = [t for t in times if t < t0][-1:] + inside + [t for t in times if t > t1][:1]
        gaps += [b - a for a, b in zip(window, window[1:], strict=False)]
        tokens += len(inside)
    return {"prefill_s": t1 - t0, "max_gap_s": max(gaps), "streams_tok_s": tokens / (t1 - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/demo.toml")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--chunks", default="64,128,256,512,1024", help=SETTINGS_HELP)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    settings: list[tuple[str, dict[str, Any]]] = [("off", {"scheduler.chunked_prefill_size": "off"})]
    for c in map(int, args.chunks.split(",")):
        settings.append((f"mixed {c}", {"scheduler.chunked_prefill_size": c, "scheduler.mixed_chunked_prefill": True}))
        settings.append((f"separate {c}", {"scheduler.chunked_prefill_size": c, "scheduler.mixed_chunked_prefill": False}))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in settings}
    for r in range(args.rounds):
        for name, overrides in settings:
            with Runtime.from_config(args.config, **{"scheduler.max_prefill_tokens": 8192, **overrides}) as rt:
                vocab = rt.engine.info["vocab_size"]
                asyncio.run(one_setting(rt, args.streams, 64, vocab, seed=99))  # warm-up
                rt.flush_cache()
                res = asyncio.run(one_setting(rt, args.streams, args.prompt_tokens, vocab, seed=r))
            results[name].append(res)
            print(f"round {r + 1} {name:>14}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    print("\nmedian over rounds:")
    print("| setting | long prompt prefill s | longest stream gap s | streams tok/s during prefill |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"| {name} | {med['prefill_s']:.2f} | {med['max_gap_s']:.3f} | {med['streams_tok_s']:.1f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"date": datetime.now(UTC).isoformat(), "argv": sys.argv, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
