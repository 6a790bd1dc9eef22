"""OpenAI tool calling: the calls of a reply (planned by `rxf.entrypoints.chat.tools`) in OpenAI's
shapes, whole or as stream deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from rxf.entrypoints.chat.tools import ToolPlan, new_call_id, reply_calls
from rxf.entrypoints.openai.protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta


def reply_message(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """A whole reply as the message's content and tool calls (None when it made no call)."""
    content, calls = reply_calls(plan, text)
    if not calls:
        return content, None
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return content or None, tool_calls


@dataclass
class ToolCallStream:
    """One choice's reply as it streams: content deltas, and per call a first delta with its id,
    type, name and the arguments so far, then argument fragments. The deltas add up to
    `reply_message`."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per call started

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        scan = self.plan.parser.scan(self.text, final)
        content, self.content_sent = scan.content[self.content_sent :], max(self.content_sent, len(scan.content))
        out = []
        for index, call in enumerate(scan.calls[: self.plan.max_calls]):
            first = index == len(self.arguments_sent)
            if first:
                self.arguments_sent.append(0)
            fragment = call.arguments[self.arguments_sent[index] :]
            self.arguments_sent[index] += len(fragment)
            if first:
                function = FunctionCallDelta(name=call.name, arguments=fragment)
                out.append(ToolCallDelta(index=index, id=new_call_id(), type="function", function=function))
            elif fragment:
                out.append(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=fragment)))
        return content, out

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)
