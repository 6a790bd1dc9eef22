"""A chat request's prompt: messages (with offered tools) rendered, tokenized and their media
preprocessed; `response_format` as a native constraint, and the constraint checked up front."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rxf.core.grammar import GRAMMAR_KINDS, GrammarError
from rxf.core.requests import RequestError, check_prompt_chars
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.messages import render_messages, template_messages
from rxf.entrypoints.chat.tool_parsers import ToolCallParser
from rxf.entrypoints.chat.tools import ToolPlan

# response_format json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass
class ChatPrompt:
    ids: list[int]  # the rendered conversation's tokens (special tokens included), media pads in place
    mm_items: list[Any] | None  # the preprocessed images / videos (None: none)


def build_chat_prompt(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    chat_template: Any,
    tool_parser: ToolCallParser | None,
    tools: ToolPlan | None = None,
    mm_processor: Any = None,
    max_context_len: int | None = None,
) -> ChatPrompt:
    """The prompt of `messages` offering `tools`. With a multimodal processor, images and videos are
    decoded and preprocessed here (blocking: call it off an event loop when there are any). With
    `max_context_len`, a rendered text too long to fit it is refused before it is tokenized."""
    images: list[Any] | None = [] if mm_processor is not None else None
    videos: list[Any] | None = [] if mm_processor is not None else None
    offered = tools.tools if tools is not None else None
    text = render_messages(template_messages(messages, images, videos), chat_template, tool_parser, offered)
    if max_context_len is not None:
        try:
            check_prompt_chars(text, tokenizer, max_context_len, "messages")
        except RequestError as exc:
            raise ChatInputError(str(exc), "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not (images or videos):
        return ChatPrompt(ids, None)
    try:
        ids, mm_items = mm_processor.process(ids, images, videos)
    except ValueError as exc:
        message = str(exc).replace("image_data", "image", 1).replace("video_data", "video", 1)
        raise ChatInputError("messages: " + message, "messages") from None
    return ChatPrompt(ids, mm_items)


def response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, str]:
    """The native constraint of a (validated) `response_format`: `{"json_schema": <text>}` for
    json_object and json_schema, `{}` for text or none."""
    kind = response_format.get("type") if response_format else None
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        return {"json_schema": json.dumps(response_format["json_schema"]["schema"])}
    return {}


def check_constraint(grammar: Any, params: dict[str, Any], param: str | None) -> None:
    """Compile the constraint in native `params` now (the backend caches it for the engine) so that
    an invalid one is a ChatInputError naming `param`, the field that set it, before the request
    starts. Blocking (a first compile may take a while)."""
    kind = next((k for k in GRAMMAR_KINDS if k in params), None)
    if kind is None:
        return
    if grammar is None:
        raise ChatInputError("structured output is not available: this server has no grammar backend", param)
    try:
        grammar.validate(kind, params[kind])
    except GrammarError as exc:  # the backend's reason ("invalid regex: ...", or why it has none)
        raise ChatInputError(f"{param}: {exc}", param) from None
