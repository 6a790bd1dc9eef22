"""POST /v1/chat/completions: messages rendered by the server's chat template, then native requests.

As `Runtime.chat` does: the rendered prompt already holds its special tokens (so it is tokenized
without adding any) and the template's stop strings are added to the request's own. Tools (see
`tool_calls`) are shown through the template, and each reply is split into content and calls.
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

from rxf.core.tokenizer_manager import GenerateRequest, RequestLimits, TokenizerManager
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.prompt import build_chat_prompt
from rxf.entrypoints.chat.tool_parsers import ToolCallParser, make_parser
from rxf.entrypoints.chat.tool_stream import ToolCallStream, finish_type
from rxf.entrypoints.chat.tools import ToolPlan, plan_tools, tool_params
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.logprobs import TokenStr, chat_logprobs, token_str_fn
from rxf.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    Delta,
    NamedToolChoice,
)
from rxf.entrypoints.openai.sampling import (
    bad_request,
    check_chat,
    check_constraint,
    check_model,
    check_priority,
    max_new_tokens,
    native_params,
    output_constraint,
    verify_native,
)
from rxf.entrypoints.openai.sse import event, sse_response
from rxf.entrypoints.openai.tool_calls import reply_message, tool_call_deltas
from rxf.entrypoints.server_state import ServerState, prepare, server_state, until_disconnected

router = APIRouter()


@dataclass
class ChatPlan:
    id: str
    ids: list[int]
    params: dict[str, Any]
    reqs: list[GenerateRequest]  # request i is choice i
    logprobs: bool
    mm_items: list[Any] | None = None  # the prompt's preprocessed images (their pads are in ids)
    tools: ToolPlan | None = None
    constraint_param: str | None = None  # the request field that set the output constraint


def plan_chat(
    req: ChatCompletionRequest,
    tokenizer: Any,
    chat_template: Any,
    context_len: int,
    vocab_size: int,
    limits: RequestLimits | None = None,
    mm_processor: Any = None,
    tool_parser: ToolCallParser | None = None,
) -> ChatPlan:
    """The native requests for `req`; raises APIError(400) naming the field for any bad value.
    `tool_parser` reads the model's tool calls (None: the one the chat template suggests). With a
    multimodal processor, images are decoded and preprocessed here (blocking: call it off the event
    loop when the request has images)."""
    check_chat(req)
    check_priority(req, limits)
    constrained_by, constraint = output_constraint(req)
    if tool_parser is None:
        tool_parser = make_parser(None, chat_template, tokenizer)
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    tool_entries = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
    messages = [msg.model_dump(exclude_unset=True) for msg in req.messages]
    try:
        tools = plan_tools(tool_entries, tool_choice, req.parallel_tool_calls, tool_parser, constrained_by or None)
        prompt = build_chat_prompt(messages, tokenizer, chat_template, tool_parser, tools, mm_processor, context_len)
    except ChatInputError as exc:
        raise bad_request(str(exc), exc.param) from None
    ids = prompt.ids
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    budget = max_new_tokens(requested, param, None, len(ids), context_len, "messages")
    params = native_params(req, budget, tuple(chat_template.stop_strings)) | constraint | tool_params(tools)
    if tools is not None and tools.json_schema is not None:
        constrained_by = "tools"
    verify_native(params, vocab_size, limits)
    rid = gen.new_id("chatcmpl")
    reqs = gen.choice_requests(
        ids,
        params,
        req.n,
        rid,
        0,
        stream=req.stream,
        return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0,
        cache_salt=req.cache_salt,
        priority=req.priority,
        mm_items=prompt.mm_items,
    )
    return ChatPlan(rid, ids, params, reqs, req.logprobs, prompt.mm_items, tools, constrained_by or None)


def _logprobs(plan: ChatPlan, meta: dict[str, Any], token_str: TokenStr) -> ChatLogprobs | None:
    if not plan.logprobs:
        return None
    return ChatLogprobs(
        content=chat_logprobs(
            meta.get("output_token_logprobs", []), meta.get("output_top_logprobs"), token_str
        )
    )


def _finish(meta: dict[str, Any], called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for a reply that ended (not cut short) with calls."""
    return finish_type(gen.finish_reason(meta), called)


def _message(plan: ChatPlan, text: str) -> ChatMessageOut:
    if plan.tools is None:
        return ChatMessageOut(content=text)
    content, calls = reply_message(plan.tools, text)
    return ChatMessageOut(content=content, tool_calls=calls)


def chat_response(
    plan: ChatPlan, results: list[dict[str, Any]], token_str: TokenStr, model: str
) -> ChatCompletionResponse:
    choices = []
    for i, result in enumerate(results):
        message = _message(plan, result["text"])
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=_logprobs(plan, result["meta_info"], token_str),
                finish_reason=_finish(result["meta_info"], message.tool_calls is not None),
            )
        )
    return ChatCompletionResponse(
        id=plan.id, created=int(time.time()), model=model, choices=choices, usage=gen.usage([results])
    )


async def chat_events(
    tm: TokenizerManager, plan: ChatPlan, token_str: TokenStr, model: str, include_usage: bool
) -> AsyncGenerator[str, None]:
    """Per choice: one chunk with the role and empty content, content (and tool call) chunks, and
    the finish_reason on that choice's last chunk only."""
    created = int(time.time())
    streams = [ToolCallStream(plan.tools) if plan.tools is not None else None for _ in plan.reqs]

    def chunk(i: int, delta: Delta, logprobs: ChatLogprobs | None = None, finish: str | None = None) -> str:
        choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        return event(ChatCompletionChunk(id=plan.id, created=created, model=model, choices=[choice]))

    for i in range(len(plan.reqs)):
        yield chunk(i, Delta(role="assistant", content=""))
    finals: list[dict[str, Any]] = [{} for _ in plan.reqs]
    async with contextlib.aclosing(gen.iterate(tm, plan.reqs)) as results:
        async for i, result in results:
            meta = result["meta_info"]
            logprobs = _logprobs(plan, meta, token_str)
            finish = gen.finish_reason(meta)
            delta = Delta(content=result["text"] or None)
            stream = streams[i]
            if stream is not None:
                content, calls = stream.feed(result["text"], final=finish is not None)
                delta = Delta(content=content or None, tool_calls=tool_call_deltas(calls) or None)
                finish = _finish(meta, stream.called)
            if finish is not None:
                finals[i] = result
            elif delta.content is None and delta.tool_calls is None and not (logprobs and logprobs.content):
                continue  # nothing to tell yet (the detokenizer may hold text back near a stop string)
            yield chunk(i, delta, logprobs, finish)
    if include_usage:
        yield event(
            ChatCompletionChunk(
                id=plan.id, created=created, model=model, choices=[], usage=gen.usage([finals])
            )
        )


def tool_parser(state: ServerState) -> ToolCallParser:
    """The server's parser of the model's tool calls (`model.tool_call_parser`), made once."""
    parser = state.extra.get("tool_parser")
    if parser is None:
        name = getattr(state.config.model, "tool_call_parser", None)
        parser = state.extra["tool_parser"] = make_parser(name, state.chat_template, state.tokenizer)
    return parser


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | StreamingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    has_images = tm.mm_processor is not None and any(isinstance(m.content, list) for m in body.messages)
    args = (body, state.tokenizer, state.chat_template, tm.max_context_len, tm.vocab_size, tm.limits,
            tm.mm_processor, tool_parser(state))
    plan = await prepare(request, plan_chat, *args, off_loop=has_images)
    await asyncio.to_thread(check_constraint, tm.grammar, plan.params, plan.constraint_param)
    tm.check_capacity(len(plan.reqs))
    if body.n > 1 and plan.mm_items is None:  # a warm-up request would carry no image features
        await gen.warm_prefixes(tm, [plan.ids], plan.params, body.cache_salt, body.priority)
    token_str = token_str_fn(state.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(chat_events(tm, plan, token_str, state.served_model_name, include_usage))
    results = await until_disconnected(request, gen.collect(tm, plan.reqs))
    if results is None:
        return Response(status_code=499)  # the client left: its requests were aborted, nobody reads this
    return chat_response(plan, results, token_str, state.served_model_name)
