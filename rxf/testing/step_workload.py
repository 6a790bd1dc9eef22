"""A workload that exercises what the engine step has to get right, for comparing configurations
(overlap scheduling on and off, CPU and GPU) through a live `Runtime`: stop strings and stop tokens,
EOS, a JSON schema with jump-forward, `n` seeded choices sharing one prefill, an abort mid-stream,
and a long prompt prefilled in chunks beside running decodes. With a small KV pool
(`cache.max_total_tokens` ~240) and an optimistic `scheduler.init_new_token_ratio`, decode also
retracts. Every request but the aborted one is deterministic (greedy, or sampled with a seed).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rxf.testing.runtime import assert_drained

GREEDY = {"temperature": 0, "ignore_eos": True}
STOP_PROMPT = "stop here please"


def stop_points(rt: Any) -> tuple[str, int]:
    """A stop string and a stop token that the stop requests' unstopped greedy output contains."""
    free = rt.generate(STOP_PROMPT, {"max_new_tokens": 40, **GREEDY})
    return free["text"][10:13], free["output_ids"][9]


def run_step_workload(rt: Any, stop_text: str, stop_token: int, json_schema: str) -> dict[str, Any]:
    """Run the workload concurrently through `rt`; per request its output ids, text and finish reason
    (`n` choices: a list), the aborted stream's ids, the final stats and the long prompt."""
    ids = rt.tokenizer.encode
    long_prompt = ids(" ".join(["a long prompt that is prefilled in chunks"] * 4))

    async def abort_after(n: int) -> list[int]:
        got = []
        stream = await rt.async_generate("the stream that is aborted", {"max_new_tokens": 60, **GREEDY}, stream=True)
        async for chunk in stream:
            got += chunk["output_ids"]
            if len(got) >= n:
                break
        await stream.aclose()
        return got

    async def run() -> dict:
        jobs = {
            "stop_text": rt.async_generate(STOP_PROMPT, {"max_new_tokens": 40, **GREEDY, "stop": [stop_text]}),
            "stop_token": rt.async_generate(STOP_PROMPT, {"max_new_tokens": 40, **GREEDY, "stop_token_ids": [stop_token]}),
            "eos": rt.async_generate(STOP_PROMPT, {"max_new_tokens": 40, "temperature": 0}),
            "json": rt.async_generate("json:", {"max_new_tokens": 200, "temperature": 0, "json_schema": json_schema}),
            "n": rt.async_generate("three choices", {"max_new_tokens": 12, "temperature": 0.9, "seed": 4}, n=3),
            "long": rt.async_generate(input_ids=long_prompt, sampling_params={"max_new_tokens": 8, **GREEDY}),
            "aborted": abort_after(5),
            **{f"load{i}": rt.async_generate(f"load {i} " * (i + 1), {"max_new_tokens": 48, **GREEDY}) for i in range(6)},
        }
        results = await asyncio.gather(*jobs.values())
        return dict(zip(jobs, results, strict=True))

    outs = asyncio.run(run())
    assert_drained(rt)
    summary = {k: _summary(v) for k, v in outs.items() if k != "aborted"}
    return {**summary, "aborted": outs["aborted"], "stats": rt.get_stats(), "long_prompt": long_prompt}


def _summary(out: dict | list[dict]) -> dict | list[dict]:
    if isinstance(out, list):  # n choices
        return [_summary(o) for o in out]
    return {"ids": out["output_ids"], "text": out["text"], "finish": out["meta_info"]["finish_reason"]}


