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

from rxf.core.requests import check_prompt_chars
from rxf.core.tokenizer_manager import GenerateRequest, RequestLimits, TokenizerManager
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.logprobs import TokenStr, chat_logprobs, token_str_fn
from rxf.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    Delta,
)
from rxf.entrypoints.openai.sampling import (
    bad_request,
    check_chat,
    check_constraint,
    check_model,
    max_new_tokens,
    native_params,
    output_constraint,
    verify_native,
)
from rxf.entrypoints.openai.sse import event, sse_response
from rxf.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, plan_tools, reply_message
from rxf.entrypoints.openai.tool_parsers import ToolCallParser, make_parser
from rxf.entrypoints.server_state import ServerState, server_state, until_disconnected
from rxf.plugins.chat_templates.tools import HermesSyntax

router = APIRouter()

_IMAGE_PARTS = ("image_url", "input_image", "image")
_VIDEO_PARTS = ("video_url", "video")


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


def template_messages(
    messages: list[ChatMessage], images: list[Any] | None = None, videos: list[Any] | None = None
) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: the keys the client sent (nulls dropped),
    with OpenAI's "developer" role as the "system" role it replaces. Media parts are refused unless
    `images` / `videos` are given (the model takes them): then each image becomes an `image_url`
    part with its URL appended to `images`, each video (a list of frame URLs) a `video` part with its
    frames appended to `videos`, in prompt order."""
    out = []
    for i, msg in enumerate(messages):
        item = msg.model_dump(exclude_unset=True)
        if isinstance(msg.content, list):
            parts = item["content"] = list(item["content"])
            for j, part in enumerate(msg.content):
                kind, where = part.get("type"), f"messages[{i}].content[{j}]"
                if kind in _IMAGE_PARTS:
                    if images is None:
                        raise bad_request(f"{where}: images are not supported by this model", "messages")
                    images.append(_image_url(part, where))
                    parts[j] = {"type": "image_url"}
                elif kind in _VIDEO_PARTS:
                    if videos is None:
                        raise bad_request(f"{where}: videos are not supported by this model", "messages")
                    videos.append(_video_frames(part, where))
                    parts[j] = {"type": "video"}
        if item["role"] == "developer":
            item["role"] = "system"
        out.append(item)
    return out


def _video_frames(part: dict[str, Any], where: str) -> list[Any]:
    """The frames of a `video` / `video_url` part: a list of image URLs (data:, or http(s)/file when
    the server allows them), as `{"type": "video", "video": [...]}` or `{"type": "video_url",
    "video_url": {"url": [...]}}`. Video files are not decoded: a single URL is refused."""
    value = part.get(part["type"])
    frames = value.get("url") if isinstance(value, dict) else value
    if not isinstance(frames, list) or not frames or not all(isinstance(f, str) and f for f in frames):
        raise bad_request(
            f"{where}: a video is a non-empty list of frame URLs (video files are not decoded); "
            f"got {type(frames).__name__}", "messages"
        )
    return frames


def _image_url(part: dict[str, Any], where: str) -> Any:
    """The image of an `image_url` / `input_image` / `image` part: a URL (data:, or http(s)/file
    when the server allows them) or base64."""
    value = part.get(part["type"])
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: expected {part['type']!r} to hold a URL string (or {{'url': ...}})", "messages")
    return url


def render_messages(
    items: list[dict[str, Any]],
    chat_template: Any,
    tool_parser: ToolCallParser | None,
    tools: ToolPlan | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The rendered prompt for template messages. Messages with tool calls or results, or offered
    tools, go through the template's tool rendering (in `tool_parser`'s format where the template
    has none; Hermes' for a parser that gives none). Raises APIError(400) naming "messages" for
    messages the template refuses."""
    with_tools = tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in items)
    try:
        if with_tools:
            syntax = tool_parser.syntax if tool_parser is not None and tool_parser.syntax else HermesSyntax()
            offered = tools.tools if tools is not None else []
            return chat_template.render_with_tools(items, offered, syntax, add_generation_prompt)
        return chat_template.render(items, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # the template names the offending message
        raise bad_request(str(exc), "messages") from None


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
    constrained_by, constraint = output_constraint(req)
    if tool_parser is None:
        tool_parser = make_parser(None, chat_template, tokenizer)
    tools = plan_tools(req, tool_parser, constrained_by or None)
    images: list[Any] | None = [] if mm_processor is not None else None
    videos: list[Any] | None = [] if mm_processor is not None else None
    prompt = render_messages(template_messages(req.messages, images, videos), chat_template, tool_parser, tools)
    check_prompt_chars(prompt, tokenizer, context_len, "messages")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    mm_items = None
    if images or videos:
        try:
            ids, mm_items = mm_processor.process(ids, images, videos)
        except ValueError as exc:
            message = str(exc).replace("image_data", "image", 1).replace("video_data", "video", 1)
            raise bad_request("messages: " + message, "messages") from None
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    budget = max_new_tokens(requested, param, None, len(ids), context_len, "messages")
    params = native_params(req, budget, tuple(chat_template.stop_strings)) | constraint
    if tools is not None and tools.json_schema is not None:
        params["json_schema"] = tools.json_schema
        constrained_by = "tools"
    elif tools is not None and tools.parser.needs_special_tokens:
        params["skip_special_tokens"] = False
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
        mm_items=mm_items,
    )
    return ChatPlan(rid, ids, params, reqs, req.logprobs, mm_items, tools, constrained_by or None)


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
    finish = gen.finish_reason(meta)
    return "tool_calls" if finish == "stop" and called else finish


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
                delta = Delta(content=content or None, tool_calls=calls or None)
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
    plan = await asyncio.to_thread(plan_chat, *args) if has_images else plan_chat(*args)
    await asyncio.to_thread(check_constraint, tm.grammar, plan.params, plan.constraint_param)
    tm.check_capacity(len(plan.reqs))
    if body.n > 1 and plan.mm_items is None:  # a warm-up request would carry no image features
        await gen.warm_prefixes(tm, [plan.ids], plan.params, body.cache_salt)
    token_str = token_str_fn(state.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(chat_events(tm, plan, token_str, state.served_model_name, include_usage))
    results = await until_disconnected(request, gen.collect(tm, plan.reqs))
    if results is None:
        return Response(status_code=499)  # the client left: its requests were aborted, nobody reads this
    return chat_response(plan, results, token_str, state.served_model_name)
