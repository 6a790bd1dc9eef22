"""POST /v1/chat/completions: messages rendered by the server's chat template, then native requests.

As `Runtime.chat` does: the rendered prompt already holds its special tokens (so it is tokenized
without adding any) and the template's stop strings are added to the request's own. Tools (see
`tool_calls`) are shown through the template, and each reply is split into its reasoning
(`reasoning_content`, by the model's reasoning parser), content and calls (`chat.reply`).
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
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.prompt import PROMPT_FIELDS, build_chat_prompt, template_variables
from rxf.entrypoints.chat.reasoning import ReasoningParser, make_reasoning_parser
from rxf.entrypoints.chat.reply import ReplyFormat, constraint_start, reply_format
from rxf.entrypoints.chat.tool_parsers import ToolCallParser, make_parser
from rxf.entrypoints.chat.tool_stream import finish_type
from rxf.entrypoints.chat.tools import ToolPlan, plan_tools, tool_params
from rxf.entrypoints.choices import choice_requests, warm_prefixes
from rxf.entrypoints.json_route import MsgspecJSONRoute, json_reply
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
    check_model,
    native_names,
    native_params,
    output_constraint,
    prepare_request,
    slow_to_plan,
)
from rxf.entrypoints.openai.sse import event, sse_response
from rxf.entrypoints.openai.tool_calls import reply_message, tool_call_deltas
from rxf.entrypoints.server_state import (
    ServerState,
    prepare,
    server_registry,
    server_state,
    until_disconnected,
)

router = APIRouter(route_class=MsgspecJSONRoute)


@dataclass
class ChatPlan:
    id: str
    prompt: PreparedRequest  # the conversation's one prepared request (choice 0 is it, or derives from it)
    reqs: list[PreparedRequest]  # request i (rid `<id>-<i>`) is choice i
    logprobs: bool
    tools: ToolPlan | None = None
    reply: ReplyFormat = ReplyFormat()  # how each reply is read (reasoning, content, calls)
    names: Mapping[str, str] = field(default_factory=dict)  # native field -> this request's (`native_names`)


def plan_chat(
    req: ChatCompletionRequest,
    preparer: RequestPreparer,
    chat_template: Any,
    tool_parser: ToolCallParser | None = None,
    reasoning_parser: ReasoningParser | None = None,
) -> ChatPlan:
    """The prepared requests for `req`; raises APIError(400) naming the field for any bad value.
    `tool_parser` reads the model's tool calls (None: the one the chat template suggests);
    `reasoning_parser` its reasoning (None: the model does not think).
    Blocking (template rendering, tokenizing, media decoding, grammar compiling): run it off the
    event loop."""
    check_chat(req)
    constrained_by, constraint = output_constraint(req)
    tokenizer = preparer.tokenizer
    if tool_parser is None:
        tool_parser = make_parser(None, chat_template, tokenizer)
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    tool_entries = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
    messages = [msg.model_dump(exclude_unset=True) for msg in req.messages]
    try:
        tools = plan_tools(tool_entries, tool_choice, req.parallel_tool_calls, tool_parser, constrained_by or None)
        variables = template_variables(req.chat_template_kwargs, req.reasoning_effort)
        prompt = build_chat_prompt(
            messages, chat_template, tool_parser, tools, preparer.mm_processor is not None,
            req.continue_final_message, variables,
        )
    except ChatInputError as exc:
        raise bad_request(str(exc), exc.param) from None
    if req.max_completion_tokens is not None:
        requested, budget_field = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, budget_field = req.max_tokens, "max_tokens"
    params = native_params(req, requested, tuple(chat_template.stop_strings)) | constraint | tool_params(tools)
    if tools is not None and tools.json_schema is not None:
        constrained_by = "tools"
    reply = reply_format(prompt.text, reasoning_parser, tools, constrained=bool(constrained_by))
    if constrained_by:
        params |= constraint_start(reply, tokenizer)
    if reasoning_parser is not None and reasoning_parser.needs_special_tokens:
        params["skip_special_tokens"] = False
    options = RequestOptions(
        stream=req.stream, return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
        cache_salt=req.cache_salt, priority=req.priority,
    )
    rid = gen.new_id("chatcmpl")
    # Left out, the budget is the whole remaining context (OpenAI's chat default).
    native = prompt.request(params, options, rid, default_max_new_tokens=None)
    names = native_names(PROMPT_FIELDS, budget_field, "top_logprobs", constrained_by or None)
    prepared = prepare_request(preparer, native, names)
    reqs = choice_requests(prepared, [f"{rid}-{i}" for i in range(req.n)])
    return ChatPlan(rid, prepared, reqs, req.logprobs, tools, reply, names)


def _logprobs(plan: ChatPlan, out: GenerateOutput, token_str: TokenStr) -> ChatLogprobs | None:
    if not plan.logprobs or out.logprobs is None:
        return None
    return ChatLogprobs(
        content=chat_logprobs(out.logprobs.output_token_logprobs, out.logprobs.output_top_logprobs, token_str)
    )


def _finish(out: GenerateOutput, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for a reply that ended (not cut short) with calls."""
    return finish_type(gen.finish_reason(out), called)


def _message(plan: ChatPlan, text: str) -> ChatMessageOut:
    reply = plan.reply.split(text)
    content, calls = reply_message(reply)
    return ChatMessageOut(content=content, reasoning_content=reply.reasoning or None, tool_calls=calls)


def chat_response(
    plan: ChatPlan, results: list[GenerateOutput], token_str: TokenStr, model: str
) -> ChatCompletionResponse:
    choices = []
    for i, result in enumerate(results):
        message = _message(plan, result.text)
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=_logprobs(plan, result, token_str),
                finish_reason=_finish(result, message.tool_calls is not None),
            )
        )
    return ChatCompletionResponse(
        id=plan.id, created=int(time.time()), model=model, choices=choices, usage=gen.usage([results])
    )


async def chat_events(
    tm: TokenizerManager, plan: ChatPlan, token_str: TokenStr, model: str, include_usage: bool
) -> AsyncGenerator[str, None]:
    """Per choice: content (and tool call) chunks, the first of them also carrying the role, and the
    finish_reason on that choice's last chunk only. No chunk goes out before the choice has output
    (as vLLM streams): a client measuring time to first token by the first chunk measures the
    first token, not the prefill's start."""
    created = int(time.time())
    streams = [plan.reply.stream() for _ in plan.reqs]
    started = [False] * len(plan.reqs)

    def chunk(i: int, delta: Delta, logprobs: ChatLogprobs | None = None, finish: str | None = None) -> str:
        choice = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        return event(ChatCompletionChunk(id=plan.id, created=created, model=model, choices=[choice]))

    finals: list[Any] = [None] * len(plan.reqs)
    async with contextlib.aclosing(gen.iterate(tm, plan.reqs, plan.names)) as results:
        async for i, result in results:
            logprobs = _logprobs(plan, result, token_str)
            finish = gen.finish_reason(result)
            stream = streams[i]
            parts = stream.feed(result.text, final=finish is not None)
            delta = Delta(
                content=parts.content or None,
                reasoning_content=parts.reasoning or None,
                tool_calls=tool_call_deltas(parts.calls) or None,
            )
            finish = _finish(result, stream.called)
            if finish is not None:
                finals[i] = result
            elif not (delta.content or delta.reasoning_content or delta.tool_calls or (logprobs and logprobs.content)):
                continue  # nothing to tell yet (the detokenizer may hold text back near a stop string)
            if not started[i]:
                started[i] = True
                delta.role = "assistant"
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
        name = state.config.model.tool_call_parser
        parser = make_parser(name, state.chat_template, state.tokenizer, server_registry(state))
        state.extra["tool_parser"] = parser
    return parser


async def prepare_chat(request: Request, state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    """`plan_chat` for a route's request: off the event loop when it decodes media or compiles a
    grammar (a forced tool choice, an output constraint)."""
    tm = state.require_ready()
    has_media = tm.preparer.mm_processor is not None and any(isinstance(m.content, list) for m in body.messages)
    forced_tools = bool(body.tools) and body.tool_choice not in (None, "none", "auto")
    slow = has_media or forced_tools or slow_to_plan(body)
    return await prepare(
        request, plan_chat, body, tm.preparer, state.chat_template, tool_parser(state), reasoning_parser(state),
        off_loop=slow,
    )


def reasoning_parser(state: ServerState) -> ReasoningParser | None:
    """The server's parser of the model's reasoning (`model.reasoning_parser`), made once."""
    if "reasoning_parser" not in state.extra:
        name = state.config.model.reasoning_parser
        state.extra["reasoning_parser"] = make_reasoning_parser(name, state.chat_template, server_registry(state))
    return state.extra["reasoning_parser"]


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> StreamingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    plan = await prepare_chat(request, state, body)
    tm.check_capacity(len(plan.reqs))
    if body.n > 1:
        await warm_prefixes(tm, [plan.prompt])
    token_str = token_str_fn(state.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(chat_events(tm, plan, token_str, state.served_model_name, include_usage))
    results = await until_disconnected(request, gen.collect(tm, plan.reqs, plan.names))
    if results is None:
        return Response(status_code=499)  # the client left: its requests were aborted, nobody reads this
    return json_reply(chat_response(plan, results, token_str, state.served_model_name))
