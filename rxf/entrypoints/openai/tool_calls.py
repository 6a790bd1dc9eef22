"""OpenAI tool calling: the calls of a reply (planned by `rxf.entrypoints.chat.tools`) in OpenAI's
shapes, whole or as stream deltas (made by `rxf.entrypoints.chat.tool_stream`)."""

from __future__ import annotations

from typing import Any

from rxf.entrypoints.chat.tools import ToolPlan, new_call_id, reply_calls
from rxf.entrypoints.openai.protocol import FunctionCall, ToolCall, ToolCallDelta


def reply_message(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A whole reply as the message's content and tool calls (None when it made no call)."""
    content, calls = reply_calls(plan, text)
    if not calls:
        return content, None
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return content or None, tool_calls


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[ToolCallDelta]:
    """`ToolCallStream`'s call deltas as protocol models."""
    return [ToolCallDelta.model_validate(call) for call in calls]
