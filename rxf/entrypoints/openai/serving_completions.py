"""POST /v1/completions: OpenAI's legacy completions as native requests.

A request with P prompts and n choices becomes P * n native requests; choice `p * n + i` is choice
i of prompt p (OpenAI's order). With n > 1 each prompt is prefilled once first so that its n
choices share its KV through the radix cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import GenerateRequest
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.entrypoints.choices import choice_requests, warm_prefixes
from rxf.entrypoints.json_route import MsgspecJSONRoute, json_reply
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
    check_model,
    native_names,
    native_params,
    output_constraint,
    prepare_request,
    slow_to_plan,
)
from rxf.entrypoints.openai.sse import event, sse_response
from rxf.entrypoints.server_state import prepare, server_state, until_disconnected

router = APIRouter(route_class=MsgspecJSONRoute)

# OpenAI's default when max_tokens is left out (cut to what the context has room for).
DEFAULT_MAX_TOKENS = 16
_PROMPT_FIELDS = {"text": "prompt", "input_ids": "prompt"}


@dataclass
class CompletionPlan:
    id: str
    prompts: list[PreparedRequest]  # one per prompt of the request, tokenized and validated once
    echoes: list[str]  # what echo prepends to each prompt's choices: its text, or its ids decoded
    # Request k (rid `<id>-<k>`) is choice k: choice i of prompt p is k = p * n + i.
    reqs: list[PreparedRequest]
    n: int
    echo: bool
    logprobs: int | None
    hidden: frozenset[int] = frozenset()  # token ids the choices' text leaves out (skipped special tokens)
    names: Mapping[str, str] = field(default_factory=dict)  # native field -> this request's (`native_names`)


PromptField = str | list[str] | list[int] | list[list[int]]


def _prompt_list(prompt: PromptField) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    return list(prompt)  # type: ignore[arg-type]


def plan_completion(req: CompletionRequest, preparer: RequestPreparer) -> CompletionPlan:
    """The prepared requests for `req`, which `check_completion` has passed; raises APIError(400)
    naming the field for any other bad value. Text is tokenized as the native API does (the
    tokenizer's special tokens, such as BOS, included). Blocking (tokenizing, grammar compiling):
    run it off the event loop."""
    constrained_by, constraint = output_constraint(req)
    params = native_params(req, req.max_tokens) | constraint
    with_logprobs = req.logprobs is not None
    options = RequestOptions(
        stream=req.stream,
        return_logprob=with_logprobs,
        # Echoed prompt logprobs start at the first prompt token (which has none).
        logprob_start_len=0 if with_logprobs and req.echo else -1,
        top_logprobs_num=req.logprobs or 0,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )
    names = native_names(_PROMPT_FIELDS, "max_tokens", "logprobs", constrained_by or None)
    skips = params.get("skip_special_tokens", True)
    hidden = frozenset(preparer.tokenizer.all_special_ids) if skips else frozenset()
    plan = CompletionPlan(gen.new_id("cmpl"), [], [], [], req.n, req.echo, req.logprobs, hidden, names)
    for p, prompt in enumerate(_prompt_list(req.prompt)):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        native = GenerateRequest(
            text=text, input_ids=ids, sampling_params=params, options=options, rid=f"{plan.id}-p{p}",
            default_max_new_tokens=DEFAULT_MAX_TOKENS,
        )
        prepared = prepare_request(preparer, native, names)
        plan.prompts.append(prepared)
        if req.echo:
            plan.echoes.append(text if text is not None else preparer.tokenizer.decode(ids, skip_special_tokens=False))
        plan.reqs += choice_requests(prepared, [f"{plan.id}-{p * req.n + i}" for i in range(req.n)])
    return plan


def _choice_logprobs(
    plan: CompletionPlan, out: GenerateOutput, token_str: TokenStr, start: int, with_prompt: bool
) -> CompletionLogprobs | None:
    """A result's (or chunk's) logprobs: the echoed prompt's tokens first when `with_prompt`
    (offsets from 0), then the generated ones, their offsets from `start`: where the generated text
    of this result or chunk begins in the choice's text."""
    lp = out.logprobs
    if plan.logprobs is None or lp is None:
        return None
    prompt_part = CompletionLogprobs()
    if with_prompt:
        prompt_part, _ = completion_logprobs(lp.input_token_logprobs or [], lp.input_top_logprobs, token_str, 0)
    output_part, _ = completion_logprobs(lp.output_token_logprobs, lp.output_top_logprobs, token_str, start,
                                         plan.hidden)
    return join_completion_logprobs(prompt_part, output_part)


def completion_response(
    plan: CompletionPlan, results: list[GenerateOutput], token_str: TokenStr, model: str
) -> CompletionResponse:
    choices = []
    for k, result in enumerate(results):
        echo = plan.echoes[k // plan.n] if plan.echo else ""
        logprobs = _choice_logprobs(plan, result, token_str, len(echo), plan.echo)
        finish = gen.finish_reason(result)
        choices.append(
            CompletionChoice(index=k, text=echo + result.text, logprobs=logprobs, finish_reason=finish)
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
    finals: list[Any] = [None] * len(plan.reqs)
    started = [False] * len(plan.reqs)
    async with contextlib.aclosing(gen.iterate(tm, plan.reqs, plan.names)) as chunks:
        async for k, chunk in chunks:
            echo = plan.echo and not started[k]
            started[k] = True
            prefix = plan.echoes[k // plan.n] if echo else ""
            logprobs = _choice_logprobs(plan, chunk, token_str, sent[k] + len(prefix), echo)
            text = prefix + chunk.text
            sent[k] += len(text)
            finish = gen.finish_reason(chunk)
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
) -> StreamingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    # The fields checked, then the batch counted before tokenizing: a batch of 300,000 prompts is
    # refused at once, not after seconds of work.
    check_completion(body)
    tm.check_capacity(len(_prompt_list(body.prompt)) * body.n)
    plan = await prepare(request, plan_completion, body, tm.preparer, off_loop=slow_to_plan(body))
    tm.check_capacity(len(plan.reqs))  # again: requests may have started while this one was prepared
    if plan.n > 1:
        await warm_prefixes(tm, plan.prompts)
    token_str = token_str_fn(state.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(completion_events(tm, plan, token_str, state.served_model_name, include_usage))
    results = await until_disconnected(request, gen.collect(tm, plan.reqs, plan.names))
    if results is None:
        return Response(status_code=499)  # the client left: its requests were aborted, nobody reads this
    return json_reply(completion_response(plan, results, token_str, state.served_model_name))
