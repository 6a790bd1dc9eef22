"""POST /v1/completions: OpenAI's legacy completions as native requests.

A request with P prompts and n choices becomes P * n native requests; choice `p * n + i` is choice
i of prompt p (OpenAI's order). With n > 1 each prompt is prefilled once first so that its n
choices share its KV through the radix cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from rxf.core.requests import check_prompt_chars
from rxf.core.tokenizer_manager import GenerateRequest, RequestLimits, TokenizerManager
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.logprobs import (
    TokenStr,
    completion_logprobs,
    join_completion_logprobs,
    token_str_fn,
)
from rxf.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from rxf.entrypoints.openai.sampling import (
    bad_request,
    check_completion,
    check_constraint,
    check_model,
    check_priority,
    max_new_tokens,
    native_params,
    output_constraint,
    verify_native,
)
from rxf.entrypoints.openai.sse import event, sse_response
from rxf.entrypoints.server_state import prepare, server_state, until_disconnected

router = APIRouter()

# OpenAI's default when max_tokens is left out (cut to what the context has room for).
DEFAULT_MAX_TOKENS = 16


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what echo prepends: the client's string, or its token ids decoded


@dataclass
class CompletionPlan:
    id: str
    prompts: list[Prompt]
    params: list[dict[str, Any]]  # native sampling params, one per prompt (their budgets differ)
    reqs: list[GenerateRequest]  # request k is choice k
    n: int
    echo: bool
    logprobs: int | None
    constraint_param: str | None = None  # the request field that set the output constraint


PromptField = str | list[str] | list[int] | list[list[int]]


def parse_prompts(
    prompt: PromptField, tokenizer: Any, vocab_size: int, context_len: int | None = None
) -> list[Prompt]:
    """One `Prompt` per prompt of the request. Text is tokenized as the native API does (the
    tokenizer's special tokens, such as BOS, included); with `context_len`, a text that cannot fit
    it is refused before it is tokenized."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    out = []
    for item in prompt:
        if isinstance(item, str):
            if context_len is not None:
                check_prompt_chars(item, tokenizer, context_len, "prompt")
            out.append(Prompt(tokenizer.encode(item), item))
        elif all(0 <= t < vocab_size for t in item):
            out.append(Prompt(list(item), tokenizer.decode(item, skip_special_tokens=False)))
        else:
            raise bad_request(f"token ids must be in [0, {vocab_size})", "prompt")
        if not out[-1].ids:
            raise bad_request("a prompt must have at least one token", "prompt")
    return out


def plan_completion(
    req: CompletionRequest, tokenizer: Any, context_len: int, vocab_size: int, limits: RequestLimits | None = None
) -> CompletionPlan:
    """The native requests for `req`; raises APIError(400) naming the field for any bad value."""
    check_completion(req)
    check_priority(req, limits)
    constrained_by, constraint = output_constraint(req)
    prompts = parse_prompts(req.prompt, tokenizer, vocab_size, context_len)
    plan = CompletionPlan(
        gen.new_id("cmpl"), prompts, [], [], req.n, req.echo, req.logprobs, constrained_by or None
    )
    with_logprobs = req.logprobs is not None
    for p, prompt in enumerate(plan.prompts):
        budget = max_new_tokens(
            req.max_tokens, "max_tokens", DEFAULT_MAX_TOKENS, len(prompt.ids), context_len, "prompt"
        )
        params = native_params(req, budget) | constraint
        verify_native(params, vocab_size, limits)
        plan.params.append(params)
        plan.reqs += gen.choice_requests(
            prompt.ids,
            params,
            req.n,
            plan.id,
            p * req.n,
            stream=req.stream,
            return_logprob=with_logprobs,
            # Echoed prompt logprobs start at the first prompt token (which has none).
            logprob_start_len=0 if with_logprobs and req.echo else -1,
            top_logprobs_num=req.logprobs or 0,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )
    return plan


def _choice_logprobs(
    plan: CompletionPlan, meta: dict[str, Any], token_str: TokenStr, start: int, with_prompt: bool
) -> CompletionLogprobs | None:
    """A result's (or chunk's) logprobs: the echoed prompt's tokens first when `with_prompt`
    (offsets from 0), then the generated ones, their offsets from `start`: where the generated text
    of this result or chunk begins in the choice's text."""
    if plan.logprobs is None:
        return None
    prompt_part = CompletionLogprobs()
    if with_prompt:
        prompt_part, _ = completion_logprobs(
            meta.get("input_token_logprobs", []), meta.get("input_top_logprobs"), token_str, 0
        )
    output_part, _ = completion_logprobs(
        meta.get("output_token_logprobs", []), meta.get("output_top_logprobs"), token_str, start
    )
    return join_completion_logprobs(prompt_part, output_part)


def completion_response(
    plan: CompletionPlan, results: list[dict[str, Any]], token_str: TokenStr, model: str
) -> CompletionResponse:
    choices = []
    for k, result in enumerate(results):
        echo = plan.prompts[k // plan.n].text if plan.echo else ""
        logprobs = _choice_logprobs(plan, result["meta_info"], token_str, len(echo), plan.echo)
        finish = gen.finish_reason(result["meta_info"])
        choices.append(
            CompletionChoice(index=k, text=echo + result["text"], logprobs=logprobs, finish_reason=finish)
        )
    grouped = [results[p * plan.n : (p + 1) * plan.n] for p in range(len(plan.prompts))]
    return CompletionResponse(
        id=plan.id, created=int(time.time()), model=model, choices=choices, usage=gen.usage(grouped)
    )


async def completion_events(
    tm: TokenizerManager, plan: CompletionPlan, token_str: TokenStr, model: str, include_usage: bool
) -> AsyncGenerator[str, None]:
    created = int(time.time())
    sent = [0] * len(plan.reqs)  # characters of each choice's text sent so far
    finals: list[dict[str, Any]] = [{} for _ in plan.reqs]
    started = [False] * len(plan.reqs)
    async with contextlib.aclosing(gen.iterate(tm, plan.reqs)) as chunks:
        async for k, chunk in chunks:
            meta = chunk["meta_info"]
            echo = plan.echo and not started[k]
            started[k] = True
            prefix = plan.prompts[k // plan.n].text if echo else ""
            logprobs = _choice_logprobs(plan, meta, token_str, sent[k] + len(prefix), echo)
            text = prefix + chunk["text"]
            sent[k] += len(text)
            finish = gen.finish_reason(meta)
            if finish is not None:
                finals[k] = chunk
            elif not text and not (logprobs and logprobs.tokens):
                continue  # nothing to tell yet (the detokenizer may hold text back near a stop string)
            choice = CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=finish)
            yield event(CompletionChunk(id=plan.id, created=created, model=model, choices=[choice]))
    if include_usage:
        grouped = [finals[p * plan.n : (p + 1) * plan.n] for p in range(len(plan.prompts))]
        yield event(
            CompletionChunk(id=plan.id, created=created, model=model, choices=[], usage=gen.usage(grouped))
        )


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, request: Request
) -> CompletionResponse | StreamingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    plan = await prepare(request, plan_completion, body, state.tokenizer, tm.max_context_len, tm.vocab_size, tm.limits)
    await asyncio.to_thread(check_constraint, tm.grammar, plan.params[0], plan.constraint_param)
    tm.check_capacity(len(plan.reqs))
    if plan.n > 1:  # the prompts' params differ only in their budget, which warming zeroes
        await gen.warm_prefixes(tm, [p.ids for p in plan.prompts], plan.params[0], body.cache_salt, body.priority)
    token_str = token_str_fn(state.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(completion_events(tm, plan, token_str, state.served_model_name, include_usage))
    results = await until_disconnected(request, gen.collect(tm, plan.reqs))
    if results is None:
        return Response(status_code=499)  # the client left: its requests were aborted, nobody reads this
    return completion_response(plan, results, token_str, state.served_model_name)
