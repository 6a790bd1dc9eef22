"""A model's reply read back, whoever serves it: its reasoning (a `ReasoningParser`'s), then, in the
text after the reasoning, its content and tool calls (the `ToolPlan`'s parser). Every front door that
answers chats - /v1/chat/completions, `Runtime.chat`, and the other APIs' routes - reads a reply
through `ReplyFormat`:

    fmt = reply_format(prompt_text, reasoning_parser, tool_plan, constrained=False)
    parts = fmt.split(whole_output)          # Reply(reasoning, content, calls)
    stream = fmt.stream()                    # per reply; stream.feed(text_delta, final) -> ReplyDelta

Streamed deltas add up to the whole split: the reasoning deltas to `reasoning`, the content deltas
to `content`, and each call's deltas (OpenAI's shape, `ToolCallStream`'s) to its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rxf.entrypoints.chat.reasoning.base import ReasoningParser, ReasoningSplit
from rxf.entrypoints.chat.tool_parsers.base import ParsedCall
from rxf.entrypoints.chat.tool_stream import ToolCallStream
from rxf.entrypoints.chat.tools import ToolPlan, reply_calls


@dataclass(frozen=True)
class Reply:
    reasoning: str | None  # None: the reply holds no reasoning
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ReplyDelta:
    reasoning: str
    content: str
    calls: list[dict[str, Any]]  # ToolCallStream's call deltas


@dataclass(frozen=True)
class ReplyFormat:
    """How one request's replies are read. `inside`: the output starts inside the reasoning (its
    prompt opened the block)."""

    reasoning: ReasoningParser | None = None
    inside: bool = False
    tools: ToolPlan | None = None

    def _split_reasoning(self, text: str, final: bool) -> ReasoningSplit:
        if self.reasoning is None:
            return ReasoningSplit(None, text)
        return self.reasoning.split(text, final=final, inside=self.inside)

    def split(self, text: str) -> Reply:
        """The whole reply's parts."""
        part = self._split_reasoning(text, final=True)
        if self.tools is None:
            return Reply(part.reasoning, part.content)
        content, calls = reply_calls(self.tools, part.content)
        return Reply(part.reasoning, content, calls)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


@dataclass
class ReplyStream:
    """One reply's deltas as its text arrives."""

    format: ReplyFormat
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0
    tool_stream: ToolCallStream | None = None

    def __post_init__(self) -> None:
        if self.format.tools is not None:
            self.tool_stream = ToolCallStream(self.format.tools)

    def feed(self, delta: str, final: bool) -> ReplyDelta:
        """What the reply's next text `delta` adds; `final` on its last piece."""
        if self.format.reasoning is None and self.tool_stream is None:
            return ReplyDelta("", delta, [])  # plain text: nothing to hold back or re-read
        self.text += delta
        part = self.format._split_reasoning(self.text, final)
        reasoning = (part.reasoning or "")[self.reasoning_sent :]
        self.reasoning_sent += len(reasoning)
        content = part.content[self.content_sent :]
        self.content_sent += len(content)
        if self.tool_stream is None:
            return ReplyDelta(reasoning, content, [])
        content, calls = self.tool_stream.feed(content, final)
        return ReplyDelta(reasoning, content, calls)

    @property
    def called(self) -> bool:
        return self.tool_stream is not None and self.tool_stream.called


def reply_format(
    prompt: str, reasoning: ReasoningParser | None, tools: ToolPlan | None, constrained: bool
) -> ReplyFormat:
    """The format of replies to `prompt` (the rendered chat). A `constrained` reply (response_format,
    forced tool calls) whose prompt opened a reasoning block with an `end_marker` thinks first: its
    grammar starts after the marker (`constraint_start`). Any other constrained reply has its grammar
    from the first token, so it cannot think: it starts outside any block."""
    inside = reasoning is not None and reasoning.starts_inside(prompt)
    if constrained and inside and reasoning.end_marker is None:
        inside = False
    return ReplyFormat(reasoning, inside, tools)


def constraint_start(fmt: ReplyFormat, tokenizer: Any) -> dict[str, Any]:
    """The native parameter that holds a constrained reply's grammar until its reasoning ends
    (`grammar_after`: the end marker's tokens, as the model writes them), or nothing."""
    if not fmt.inside or fmt.reasoning is None or fmt.reasoning.end_marker is None:
        return {}
    return {"grammar_after": tokenizer.encode(fmt.reasoning.end_marker, add_special_tokens=False)}
