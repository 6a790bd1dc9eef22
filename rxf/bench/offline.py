"""`rxf bench offline`: the serve workloads through `Runtime`, without HTTP.

Same scheduling, timing and figures as `rxf bench serve`; comparing the two separates the HTTP
server's overhead from the engine's speed. Runtime stream chunks carry the new text and
`meta_info.completion_tokens` (cumulative), so token counts are the engine's own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rxf.bench.client import RequestResult
from rxf.bench.datasets import BenchRequest
from rxf.bench.serve import print_summary, run_requests, write_results


async def send_runtime(rt: Any, req: BenchRequest, ignore_eos: bool = True) -> RequestResult:
    params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}
    start = time.perf_counter()
    first: float | None = None
    last = start
    itl: list[float] = []
    meta: dict[str, Any] = {}
    try:
        async for chunk in await rt.async_generate(req.prompt, params, stream=True):
            now = time.perf_counter()
            meta = chunk["meta_info"]
            if not chunk["text"]:
                continue
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
    except Exception as e:  # the run goes on; the failure is counted
        return RequestResult(False, req.prompt_len, start=start, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, req.prompt_len, start=start, error="no text generated")
    return RequestResult(
        ok=True,
        prompt_len=meta.get("prompt_tokens", req.prompt_len),
        output_len=meta.get("completion_tokens", len(itl) + 1),
        ttft=first - start,
        e2e=end - start,
        itl=itl,
        cached_tokens=meta.get("cached_tokens"),
        start=start,
    )


def cmd_offline(args: Any, overrides: dict[str, Any]) -> int:
    """`rxf bench offline --config X.toml`: see the CLI's help."""
    from rxf import Runtime
    from rxf.bench.datasets import workload_from_args

    with Runtime.from_config(args.config, **overrides) as rt:
        requests = workload_from_args(args, rt.tokenizer)
        before = rt.get_stats()
        results, duration = asyncio.run(
            run_requests(
                requests, lambda r: send_runtime(rt, r, not args.no_ignore_eos), args.request_rate,
                args.max_concurrency, args.seed, progress=not args.no_progress,
            )
        )
        after = rt.get_stats()
    from rxf.bench.metrics import summarize

    summary = summarize(results, duration)
    prompt = after.extra["prompt_tokens"] - before.extra["prompt_tokens"]
    if prompt > 0:
        summary["server_cache_hit_rate"] = (after.extra["cached_tokens"] - before.extra["cached_tokens"]) / prompt
    print_summary(summary, f"rxf bench offline: {args.dataset}")
    if args.output:
        write_results(args.output, vars(args) | {"set": overrides}, summary, results)
    return 0 if summary["completed"] else 1
