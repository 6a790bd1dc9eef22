"""Anthropic's stream events for replies with text and tool calls, whatever the pieces the engine's
outputs cut them into: the events, read as the `anthropic` SDK reads them (its accumulator builds
the final message), give the content blocks of the non-streamed reply. The engine is a fake that
yields a recorded reply in pieces; the server path itself is tests/server/test_anthropic_api.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.ipc.messages import ABORT_REQUESTED, FinishReason
from rxf.entrypoints.anthropic import translate
from rxf.entrypoints.anthropic.errors import error_event
from rxf.entrypoints.anthropic.stream import BlockWriter, message_events
from rxf.entrypoints.chat.reasoning.think import ThinkParser
from rxf.entrypoints.chat.reply import ReplyFormat
from rxf.entrypoints.chat.tool_parsers.hermes import HermesParser
from rxf.entrypoints.chat.tools import ToolPlan, reply_calls
from rxf.entrypoints.openai.serving_chat import ChatPlan
from rxf.entrypoints.openai.sse import sse_response

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
REPLY = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         '</tool_call>\nAnd Lyon:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


class FakeEngine:
    """Yields one request's reply as outputs of the given pieces (the last one finishing it)."""

    def __init__(self, pieces: list[str], finish: FinishReason) -> None:
        self.pieces, self.finish = pieces, finish

    async def generate(self, req: Any):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield GenerateOutput("r", piece, [], prompt_tokens=10, completion_tokens=i + 1, cached_tokens=4,
                                 finish_reason=self.finish if last else None)


def _plan(tools: bool, thinks: bool = False) -> ChatPlan:
    plan = ToolPlan(TOOLS, HermesParser()) if tools else None
    reply = ReplyFormat(ThinkParser() if thinks else None, thinks, plan)
    return ChatPlan("chatcmpl-x", None, [None], False, plan, reply)  # type: ignore[arg-type]


def _events(pieces: list[str], finish: FinishReason, tools: bool = True, thinks: bool = False) -> list[str]:
    async def run() -> list[str]:
        plan = _plan(tools, thinks)
        stream = message_events(FakeEngine(pieces, finish), plan, "demo", "msg_1", ["STOP"])  # type: ignore[arg-type]
        return [item async for item in stream]

    return asyncio.run(run())


def _parsed(raw: list[str]) -> list[Any]:
    out = []
    for item in raw:
        kind, data = item.strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        if payload["type"] != "ping":  # the SDK skips pings
            out.append(EVENTS.validate_python(payload))
    return out


def _final(raw: list[str]) -> Any:
    """The message the SDK's stream helper builds from the events (its accumulator, which parses
    each tool_use block's input from its input_json_delta fragments)."""
    snapshot, buffers = None, {}
    for event in _parsed(raw):
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return snapshot


def _pieces(text: str, cut: int) -> list[str]:
    """`text` in pieces of `cut` characters."""
    return [text[i : i + cut] for i in range(0, len(text), cut)]


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 40, len(REPLY)])
def test_text_and_calls_as_the_sdk_reads_them(cut):
    """The blocks come in the reply's order (text, a call, the text after it, the next call); a
    non-streamed reply has the same text, in one block before its calls, and the same calls."""
    raw = _events(_pieces(REPLY, cut), FinishReason("stop", matched=2))
    final = _final(raw)
    content, calls = reply_calls(ToolPlan(TOOLS, HermesParser()), REPLY)
    whole = translate.reply_blocks(None, content, calls)
    assert [b.type for b in whole] == ["text", "tool_use", "tool_use"]
    one_piece = cut == len(REPLY)
    assert [b.type for b in final.content] == (["text", "tool_use", "tool_use"] if one_piece else
                                               ["text", "tool_use", "text", "tool_use"])
    assert "".join(b.text for b in final.content if b.type == "text") == content == "Let me look that up.\nAnd Lyon:"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in whole[1:]]
    assert whole[1].input == {"city": "Paris", "days": 3} and whole[2].input == {"city": "Lyon"}
    assert final.stop_reason == "tool_use" and final.usage.input_tokens == 6 and final.usage.cache_read_input_tokens == 4
    kinds = [e.type for e in _parsed(raw)]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(final.content)


def test_stop_sequence_and_end_turn():
    final = _final(_events(["The answer", " is"], FinishReason("stop", matched="STOP"), tools=False))
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"
    assert final.content[0].text == "The answer is"
    final = _final(_events(["Done."], FinishReason("stop", matched=2), tools=False))
    assert final.stop_reason == "end_turn" and final.stop_sequence is None


def test_an_empty_reply_has_no_block():
    kinds = [e.type for e in _parsed(_events([""], FinishReason("length"), tools=False))]
    assert kinds == ["message_start", "message_delta", "message_stop"]


def test_an_abort_is_an_error_event():
    async def run() -> list[str]:
        stream = message_events(FakeEngine(["Hel", "lo"], FinishReason("abort", message=ABORT_REQUESTED)),
                                _plan(False), "demo", "msg_1", None)  # type: ignore[arg-type]
        response = sse_response(stream, error_event, end="")
        return [item async for item in response.body_iterator]  # type: ignore[misc]

    raw = asyncio.run(run())
    assert raw[-1].startswith("event: error\n")
    error = json.loads(raw[-1].split("\n")[1].removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": error["error"]["message"]}}
    assert "aborted" in error["error"]["message"]


THOUGHT = "The user wants Paris.\n</think>\n\n" + REPLY  # the prompt opened the block


@pytest.mark.parametrize("cut", [1, 3, 8, len(THOUGHT)])
def test_reasoning_streams_as_a_thinking_block_first(cut):
    """The reply's reasoning (its parser's) is one thinking block ahead of the text and calls, as
    the non-streamed reply's blocks read."""
    final = _final(_events(_pieces(THOUGHT, cut), FinishReason("stop", matched=2), thinks=True))
    whole = _plan(True, thinks=True).reply.split(THOUGHT)
    assert whole.reasoning == "The user wants Paris."
    assert final.content[0].type == "thinking" and final.content[0].thinking == whole.reasoning
    assert [b.type for b in final.content[1:]] == (["text", "tool_use", "tool_use"] if cut == len(THOUGHT) else
                                                   ["text", "tool_use", "text", "tool_use"])
    assert "".join(b.text for b in final.content if b.type == "text") == whole.content
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Lyon"})]


def test_thinking_blocks_come_first():
    """Reasoning text opens a thinking block before the text."""
    writer = BlockWriter()
    raw = writer.thinking("Let me think.") + writer.thinking(" Done.") + writer.text("Paris.") + writer.close()
    events = _parsed(raw)
    assert [e.type for e in events] == ["content_block_start", "content_block_delta", "content_block_delta",
                                        "content_block_stop", "content_block_start", "content_block_delta",
                                        "content_block_stop"]
    assert events[0].content_block.type == "thinking" and events[1].delta.thinking == "Let me think."
    assert [b.type for b in translate.reply_blocks("Let me think. Done.", "Paris.", [])] == ["thinking", "text"]
