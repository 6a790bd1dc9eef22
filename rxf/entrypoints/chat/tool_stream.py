"""A reply with tools as it streams, whoever streams it: text deltas without the call markup, and the
calls as they are parsed. `Runtime.chat(stream=True)` hands these deltas out as dicts; the OpenAI
layer wraps the same dicts in its protocol models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rxf.entrypoints.chat.tools import ToolPlan, new_call_id


@dataclass
class ToolCallStream:
    """One reply's deltas. Per call: a first delta `{"index", "id", "type": "function", "function":
    {"name", "arguments"}}` with the arguments so far, then `{"index", "function": {"arguments"}}`
    fragments. Invariant: the content deltas concatenate to `reply_calls`' content and each call's
    fragments to its arguments."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)  # per call started

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content and call deltas that `delta` (the reply's next text) adds; `final` on its
        last piece, when the parser gives up waiting for markup that might still complete."""
        self.text += delta
        scan = self.plan.parser.scan(self.text, final)
        content, self.content_sent = scan.content[self.content_sent :], max(self.content_sent, len(scan.content))
        out: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls[: self.plan.max_calls]):
            first = index == len(self.arguments_sent)
            if first:
                self.arguments_sent.append(0)
            fragment = call.arguments[self.arguments_sent[index] :]
            self.arguments_sent[index] += len(fragment)
            if first:
                function = {"name": call.name, "arguments": fragment}
                out.append({"index": index, "id": new_call_id(), "type": "function", "function": function})
            elif fragment:
                out.append({"index": index, "function": {"arguments": fragment}})
        return content, out

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)


def finish_type(finish: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for a reply with tools: "tool_calls" for one that ended (not cut short)
    with calls."""
    return "tool_calls" if finish == "stop" and called else finish
