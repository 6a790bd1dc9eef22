"""Running several native requests for one OpenAI request (n choices, batch prompts) over
`rxf.entrypoints.choices`, which says how choices are derived, seeded and driven.

An abort that was asked for (`/abort_request`, the drain of a shutdown) ends its choice with
finish_reason "abort", as vLLM's do: the answer so far, marked as cut short. An abort that reports a
failure is an error: a 400 where the request's own input caused it (a grammar no further output can
satisfy, `FinishReason.status`), else a 500 (an internal error, a request the scheduler cannot run);
streaming, an error event carrying the engine's message.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.frontend.requests import RequestError
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc.messages import ABORT_REQUESTED, FinishReason, PreparedRequest
from rxf.entrypoints.choices import interleave
from rxf.entrypoints.openai.protocol import PromptTokensDetails, Usage
from rxf.entrypoints.server_state import APIError, engine_api_error


def _abort_error(finish: FinishReason, names: Mapping[str, str]) -> APIError:
    message = finish.message or "aborted"
    if finish.status is not None:  # the request's own input failed it (its grammar): the message names
        # the native field, here renamed to this route's (`native_names`)
        error = engine_api_error(RequestError(message).renamed(names))
        assert error is not None  # a RequestError is always a 400
        return APIError(finish.status, error.message, param=error.param, code="request_aborted")
    return APIError(
        500, f"the request was aborted by the engine: {message}", type="server_error", code="request_aborted"
    )


async def iterate(
    tm: TokenizerManager, reqs: list[PreparedRequest], names: Mapping[str, str] | None = None
) -> AsyncGenerator[tuple[int, GenerateOutput], None]:
    """Runs `reqs` concurrently and yields `(request index, output)` as outputs arrive. The first
    failure is raised (RequestError, EngineDeadError: the server's handlers know them; the other
    requests are aborted); an engine abort as an `APIError` naming the field by `names` (the
    route's `native_names`)."""
    async with contextlib.aclosing(interleave(tm, reqs)) as outputs:
        async for index, out in outputs:
            finish = out.finish_reason
            if finish is not None and finish.type == "abort" and finish.message != ABORT_REQUESTED:
                raise _abort_error(finish, names or {})
            yield index, out


async def collect(
    tm: TokenizerManager, reqs: list[PreparedRequest], names: Mapping[str, str] | None = None
) -> list[GenerateOutput]:
    """The final results of non-streaming `reqs`, in order (`iterate`'s errors)."""
    results: list[Any] = [None] * len(reqs)
    async with contextlib.aclosing(iterate(tm, reqs, names)) as outputs:
        async for index, result in outputs:
            results[index] = result
    return results


def usage(prompt_results: list[list[GenerateOutput]]) -> Usage:
    """Usage over the results grouped by prompt: a prompt's tokens count once, however many
    choices it has; its cached tokens are the most any of its choices found in the cache (all of
    them share the one prefill of its prompt); completion tokens add up over every choice."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    for results in prompt_results:
        prompt_tokens += results[0].prompt_tokens
        cached_tokens += max(r.cached_tokens for r in results)
        completion_tokens += sum(r.completion_tokens for r in results)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def finish_reason(out: GenerateOutput) -> str | None:
    """OpenAI's finish_reason for an output: "stop" (EOS, stop token or string), "length", "abort"
    (asked for; `iterate` raises the others), or None while running."""
    return None if out.finish_reason is None else out.finish_reason.type


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
