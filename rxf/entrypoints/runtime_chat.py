"""What `Runtime.chat` adds to a generation: its inputs in OpenAI's shapes (messages with image parts,
`tools`, `tool_choice`, `response_format`), validated by the OpenAI protocol's models so that both
front doors accept the same requests; the prompt and tool plan of `rxf.entrypoints.chat`; and the
tool calls read from the reply, whole or as it streams (`ToolCallStream`, as the server's SSE).
Every bad input raises a ValueError naming the field (a `ChatInputError`, or the preparer's
`RequestError` in the chat's terms)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

from pydantic import TypeAdapter, ValidationError

from rxf.core.echo import echo
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import RequestError
from rxf.core.grammar import GRAMMAR_KINDS
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.core.sampling_params import DEFAULT_MAX_NEW_TOKENS
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.prompt import (
    PROMPT_FIELDS,
    ChatPrompt,
    build_chat_prompt,
    response_format_constraint,
    template_variables,
)
from rxf.entrypoints.chat.reasoning import ReasoningParser
from rxf.entrypoints.chat.reply import ReplyFormat, ReplyStream, constraint_start, reply_format
from rxf.entrypoints.chat.tool_parsers import ToolCallParser
from rxf.entrypoints.chat.tool_stream import finish_type
from rxf.entrypoints.chat.tools import ToolPlan, new_call_id, plan_tools, tool_params


@dataclass
class ChatCall:
    prompt: ChatPrompt
    params: dict[str, Any]  # native sampling params: the caller's, the template's stops, constraints
    tools: ToolPlan | None
    constraint_param: str | None  # the input that set the output constraint (None: none did)
    format: ReplyFormat | None = None  # how replies are read (None: for `tools` alone)
    streams: dict[int, ReplyStream] = field(default_factory=dict)  # per choice index, while streaming

    def __post_init__(self) -> None:
        if self.format is None:
            self.format = ReplyFormat(tools=self.tools)

    def prepare(self, preparer: RequestPreparer, options: RequestOptions, rid: str | None) -> PreparedRequest:
        """The prepared request (blocking: media decoding, grammar compiling); a RequestError
        names the chat's own input (`messages`, `response_format`, `tools`)."""
        names = dict(PROMPT_FIELDS)
        if self.constraint_param is not None:
            names |= {f"sampling_params.{kind}": self.constraint_param for kind in GRAMMAR_KINDS}
        try:
            return preparer.prepare(self.prompt.request(self.params, options, rid, DEFAULT_MAX_NEW_TOKENS))
        except RequestError as exc:
            raise exc.renamed(names) from None

    def reply(self, result: dict[str, Any]) -> dict[str, Any]:
        """The native result; for a thinking model, its text after the reasoning and
        `reasoning_content` (None when it did not think); with tools offered, its text without the
        call markup and, when the model made calls, `tool_calls`: [{id, type: "function", function:
        {name, arguments}}] (and finish_reason type "tool_calls" if it ended by a stop)."""
        assert self.format is not None
        if self.tools is None and self.format.reasoning is None:
            return result
        parts = self.format.split(result["text"])
        out = {**result, "text": parts.content}
        if self.format.reasoning is not None:
            out["reasoning_content"] = parts.reasoning
        if self.tools is None:
            return out
        out = _with_finish(out, bool(parts.calls))
        if parts.calls:
            out["tool_calls"] = [
                {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parts.calls
            ]
        return out

    def reply_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk; with tools offered, its text delta without the call markup and its
        `tool_calls` deltas (`ToolCallStream`'s: a call's first names it, later ones add argument
        pieces), finish_reason type "tool_calls" on the last chunk of a reply that made calls."""
        assert self.format is not None
        if self.tools is None and self.format.reasoning is None:
            return chunk
        stream = self.streams.setdefault(chunk.get("index", 0), self.format.stream())
        final = chunk["meta_info"].get("finish_reason") is not None
        parts = stream.feed(chunk["text"], final)
        out = {**chunk, "text": parts.content}
        if self.format.reasoning is not None:
            out["reasoning_content"] = parts.reasoning
        if self.tools is None:
            return out
        out["tool_calls"] = parts.calls
        return _with_finish(out, stream.called) if final else out

    def reply_stream(self, chunks: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        with contextlib.closing(chunks):  # stopping early closes the native stream: an abort
            for chunk in chunks:
                yield self.reply_chunk(chunk)

    async def areply_stream(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield self.reply_chunk(chunk)


def _with_finish(result: dict[str, Any], called: bool) -> dict[str, Any]:
    """`result` with the finish type the server gives: "tool_calls" for a stop after calls."""
    meta = result.get("meta_info") or {}
    finish = meta.get("finish_reason")
    if finish is None or finish_type(finish["type"], called) == finish["type"]:
        return result
    return {**result, "meta_info": {**meta, "finish_reason": {**finish, "type": "tool_calls"}}}


def prepare_chat(
    messages: Any,
    sampling_params: dict[str, Any] | None,
    *,
    chat_template: Any,
    tool_parser: ToolCallParser,
    tokenizer: Any,
    reasoning_parser: ReasoningParser | None = None,
    takes_media: bool = False,
    tools: Any = None,
    tool_choice: Any = None,
    response_format: Any = None,
    parallel_tool_calls: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    reasoning_effort: str | None = None,
) -> ChatCall:
    """The prompt and native params of a chat call, to prepare with `ChatCall.prepare`."""
    # Imported here, not at the top: the protocol's package loads the whole HTTP layer (FastAPI),
    # which a Runtime that never chats need not import.
    from rxf.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessages, ResponseFormat, Tool

    items = [m.model_dump(exclude_unset=True) for m in _validate(ChatMessages, messages, "messages")]
    entries = None if tools is None else [t.model_dump(exclude_none=True) for t in _validate(list[Tool], tools, "tools")]
    choice = _tool_choice(tool_choice)
    fmt = None if response_format is None else _validate(ResponseFormat, response_format, "response_format")
    params = dict(sampling_params or {})
    constraints = [f"sampling_params.{kind}" for kind in GRAMMAR_KINDS if params.get(kind) is not None]
    constraint = response_format_constraint(fmt.model_dump(by_alias=True) if fmt is not None else None)
    if constraint:
        constraints.append("response_format")
    if len(constraints) > 1:
        raise ChatInputError(
            f"at most one output constraint may be set; got {constraints[0]} and {constraints[1]}", constraints[1]
        )
    plan = plan_tools(entries, choice, parallel_tool_calls, tool_parser, constraints[0] if constraints else None)
    effort_type = ChatCompletionRequest.model_fields["reasoning_effort"].annotation
    variables = template_variables(
        _validate(dict[str, Any] | None, chat_template_kwargs, "chat_template_kwargs"),
        _validate(effort_type, reasoning_effort, "reasoning_effort"),
    )
    prompt = build_chat_prompt(items, chat_template, tool_parser, plan, takes_media, variables)
    stop = params.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    stop += [s for s in chat_template.stop_strings if s not in stop]
    params.pop("stop", None)
    params |= ({"stop": stop} if stop else {}) | constraint | tool_params(plan)
    if plan is not None and plan.json_schema is not None:
        constrained_by: str | None = "tools"
    else:
        constrained_by = "response_format" if constraint else None
    if reasoning_parser is not None and reasoning_parser.needs_special_tokens:
        params["skip_special_tokens"] = False
    constrained = bool(constraints) or constrained_by is not None
    fmt = reply_format(prompt.text, reasoning_parser, plan, constrained)
    if constrained:
        params |= constraint_start(fmt, tokenizer)
    return ChatCall(prompt, params, plan, constrained_by, fmt)


def _tool_choice(tool_choice: Any) -> str | dict[str, Any] | None:
    from rxf.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice

    choices = get_args(get_args(ChatCompletionRequest.model_fields["tool_choice"].annotation)[0])
    if tool_choice is None or tool_choice in choices:
        return tool_choice
    if isinstance(tool_choice, str):
        raise ChatInputError(
            f"tool_choice: expected one of {', '.join(map(repr, choices))} or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {echo(tool_choice)}", "tool_choice"
        )
    return _validate(NamedToolChoice, tool_choice, "tool_choice").model_dump()


def _validate(kind: Any, value: Any, field: str) -> Any:
    """`value` validated as `kind`; the first error names its place (`tools[0].function.name: ...`)."""
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        raise ChatInputError(f"{where}: {error['msg']}", field) from None
