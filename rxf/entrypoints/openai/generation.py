"""Running several native requests for one OpenAI request (n choices, batch prompts) over
`rxf.entrypoints.choices`, which says how choices are seeded and driven.

An abort that was asked for (`/abort_request`, the drain of a shutdown) ends its choice with
finish_reason "abort", as vLLM's do: the answer so far, marked as cut short. An abort that reports a
failure (an internal error, a request the scheduler cannot run) is an error: a 500 (non-streaming)
or an error event (streaming) carrying the engine's message.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from rxf.core.io_struct import ABORT_REQUESTED
from rxf.core.tokenizer_manager import GenerateRequest, TokenizerManager
from rxf.entrypoints.choices import choice_params, interleave, prefill_request
from rxf.entrypoints.openai.protocol import PromptTokensDetails, Usage
from rxf.entrypoints.server_state import APIError


def _abort_error(meta: dict[str, Any]) -> APIError:
    reason = meta.get("finish_reason") or {}
    message = reason.get("message") or "aborted"
    return APIError(
        500, f"the request was aborted by the engine: {message}", type="server_error", code="request_aborted"
    )


async def iterate(
    tm: TokenizerManager, reqs: list[GenerateRequest]
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Runs `reqs` concurrently and yields `(request index, chunk)` as chunks arrive. The first
    failure is raised (RequestError, EngineDeadError: the server's handlers know them; the other
    requests are aborted); an engine abort as an `APIError`."""
    async with contextlib.aclosing(interleave(tm, reqs)) as chunks:
        async for index, item in chunks:
            finish = item["meta_info"].get("finish_reason")
            if finish is not None and finish["type"] == "abort" and finish.get("message") != ABORT_REQUESTED:
                raise _abort_error(item["meta_info"])
            yield index, item


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
    await collect(
        tm,
        [
            prefill_request(GenerateRequest(input_ids=ids, sampling_params=params, cache_salt=cache_salt, priority=priority))
            for ids in prompts
        ],
    )


def choice_requests(
    ids: list[int], params: dict[str, Any], n: int, rid_prefix: str, first_index: int, **options: Any
) -> list[GenerateRequest]:
    """The n native requests of one prompt; request i is choice `first_index + i`."""
    reqs = []
    for i in range(n):
        reqs.append(
            GenerateRequest(
                input_ids=ids, sampling_params=choice_params(params, i), rid=f"{rid_prefix}-{first_index + i}",
                **options,
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
    """OpenAI's finish_reason for a chunk: "stop" (EOS, stop token or string), "length", "abort"
    (asked for; `iterate` raises the others), or None while running."""
    finish = meta.get("finish_reason")
    return None if finish is None else finish["type"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
