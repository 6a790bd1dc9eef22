"""OpenAI tool calling: the calls of a reply (planned by `rxf.entrypoints.chat.tools`, read by
`rxf.entrypoints.chat.reply`) in OpenAI's shapes, whole or as stream deltas (made by
`rxf.entrypoints.chat.tool_stream`)."""

from __future__ import annotations

from typing import Any

from rxf.entrypoints.chat.reply import Reply
from rxf.entrypoints.chat.tools import new_call_id
from rxf.entrypoints.openai.protocol import FunctionCall, ToolCall, ToolCallDelta


def reply_message(reply: Reply) -> tuple[str | None, list[ToolCall] | None]:
    """A whole reply as the message's content and tool calls (None when it made no call)."""
    if not reply.calls:
        return reply.content, None
    calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in reply.calls]
    return reply.content or None, calls


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[ToolCallDelta]:
    """`ToolCallStream`'s call deltas as protocol models."""
    return [ToolCallDelta.model_validate(call) for call in calls]
