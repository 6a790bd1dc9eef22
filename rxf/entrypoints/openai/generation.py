"""Running several native requests for one OpenAI request (n choices, batch prompts).

Each native request is driven by its own task that feeds one queue. Closing or cancelling the
consumer cancels those tasks, and cancelling a task inside `TokenizerManager.generate` makes that
generator's `finally` send the abort to the scheduler. The tasks are separate from the HTTP
handler's task on purpose: when the server cancels the handler (a client hung up), the handler's
cancellation scope may keep cancelling every await it makes, but the abort is sent from the
request's own task, which is outside that scope.

Engine aborts are errors, never a finish_reason: an OpenAI client cannot tell a truncated answer
from a complete one by "stop", so an abort becomes a 500 (non-streaming) or an error event
(streaming) carrying the engine's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from rxf.core.tokenizer_manager import GenerateRequest, TokenizerManager
from rxf.entrypoints.openai.protocol import PromptTokensDetails, Usage
from rxf.entrypoints.server_state import APIError

_END = object()


def _abort_error(meta: dict[str, Any]) -> APIError:
    reason = meta.get("finish_reason") or {}
    message = reason.get("message") or "aborted"
    return APIError(
        500, f"the request was aborted by the engine: {message}", type="server_error", code="request_aborted"
    )


async def _pump(tm: TokenizerManager, index: int, req: GenerateRequest, queue: asyncio.Queue[Any]) -> None:
    try:
        async for chunk in tm.generate(req):
            queue.put_nowait((index, chunk))
    except Exception as exc:  # CancelledError is not an Exception: it ends the task (and the request)
        queue.put_nowait((index, exc))
        return
    queue.put_nowait((index, _END))


async def iterate(
    tm: TokenizerManager, reqs: list[GenerateRequest]
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Runs `reqs` concurrently and yields `(request index, chunk)` as chunks arrive. The first
    failure is raised (and the other requests are aborted); an engine abort as an `APIError`."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(tm, i, req, queue)) for i, req in enumerate(reqs)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
                continue
            if isinstance(item, Exception):
                raise item  # RequestError, EngineDeadError: the server's handlers know them
            finish = item["meta_info"].get("finish_reason")
            if finish is not None and finish["type"] == "abort":
                raise _abort_error(item["meta_info"])
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(tm: TokenizerManager, reqs: list[GenerateRequest]) -> list[dict[str, Any]]:
    """The final results of non-streaming `reqs`, in order."""
    results: list[dict[str, Any]] = [{} for _ in reqs]
    async with contextlib.aclosing(iterate(tm, reqs)) as chunks:
        async for index, result in chunks:
            results[index] = result
    return results


async def warm_prefixes(
    tm: TokenizerManager,
    prompts: Iterable[list[int]],
    params: dict[str, Any],
    cache_salt: str | None = None,
    priority: int = 0,
) -> None:
    """Prefill each prompt once (no tokens generated) so its KV is in the radix cache before its n
    choices run concurrently: they then share it instead of each prefilling the prompt."""
    prefill_only = params | {"max_new_tokens": 0, "min_new_tokens": 0}
    await collect(
        tm,
        [
            GenerateRequest(input_ids=ids, sampling_params=prefill_only, cache_salt=cache_salt, priority=priority)
            for ids in prompts
        ],
    )


def choice_requests(
    ids: list[int], params: dict[str, Any], n: int, rid_prefix: str, first_index: int, **options: Any
) -> list[GenerateRequest]:
    """The n native requests of one prompt; request i is choice `first_index + i` and, when
    seeded, uses seed + i (choice 0 keeps the client's seed)."""
    reqs = []
    for i in range(n):
        choice_params = params if i == 0 or "seed" not in params else params | {"seed": params["seed"] + i}
        reqs.append(
            GenerateRequest(
                input_ids=ids, sampling_params=choice_params, rid=f"{rid_prefix}-{first_index + i}", **options
            )
        )
    return reqs


def usage(prompt_results: list[list[dict[str, Any]]]) -> Usage:
    """Usage over the results grouped by prompt: a prompt's tokens count once, however many
    choices it has; its cached tokens are the most any of its choices found in the cache (all of
    them share the one prefill of its prompt); completion tokens add up over every choice."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    for results in prompt_results:
        metas = [r["meta_info"] for r in results]
        prompt_tokens += metas[0]["prompt_tokens"]
        cached_tokens += max(m["cached_tokens"] for m in metas)
        completion_tokens += sum(m["completion_tokens"] for m in metas)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def finish_reason(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason for a chunk: "stop" (EOS, stop token or string), "length", or None
    while running. Aborts never get here: `iterate` raises them."""
    finish = meta.get("finish_reason")
    return None if finish is None else finish["type"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
