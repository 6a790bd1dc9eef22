"""A streamed message in Anthropic's events: `message_start` (with the prompt's usage) and a
`ping` once the engine's first output is there, then content blocks, each `content_block_start`,
its `content_block_delta`s (`text_delta`, `thinking_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`.

Invariant: at most one block is open, and blocks are numbered in the order they open; a tool_use
block's `input_json_delta` fragments concatenate to its input's JSON text, its text blocks' deltas
to the non-streamed reply's text.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel

from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.entrypoints.anthropic import translate
from rxf.entrypoints.anthropic.protocol import MessageResponse, TextOut, ThinkingOut, ToolUseOut
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.serving_chat import ChatPlan


def event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind} | payload)}\n\n"


class BlockWriter:
    """The content block events of one reply, as its pieces arrive."""

    def __init__(self) -> None:
        self.index = -1  # the last block opened
        self.open: str | None = None  # its type while it is open
        self.call_blocks: dict[int, int] = {}  # a call's index in the reply -> its block's index

    def _start(self, block: BaseModel) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = block.type  # type: ignore[attr-defined]
        return events + [event("content_block_start", {"index": self.index, "content_block": block.model_dump()})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def thinking(self, text: str) -> list[str]:
        """Reasoning text (the reply's, as its reasoning parser reads it)."""
        if not text:
            return []
        events = self._start(ThinkingOut(thinking="")) if self.open != "thinking" else []
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = self._start(TextOut(text="")) if self.open != "text" else []
        return events + [self._delta({"type": "text_delta", "text": text})]

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A `ToolCallStream` call delta: a call's first opens its tool_use block (input `{}`, as
        Anthropic's start), every one adds its arguments' fragment."""
        events = []
        if "id" in delta:
            block = ToolUseOut(id=translate.new_tool_use_id(), name=delta["function"]["name"], input={})
            events = self._start(block)
            self.call_blocks[delta["index"]] = self.index
        fragment = delta["function"].get("arguments") or ""
        if fragment:
            assert self.call_blocks[delta["index"]] == self.index  # a call's fragments follow its start
            events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events


async def message_events(
    tm: TokenizerManager, plan: ChatPlan, model: str, message_id: str, stop_sequences: list[str] | None
) -> AsyncGenerator[str, None]:
    reply = plan.reply.stream()
    blocks = BlockWriter()
    started = False
    async with contextlib.aclosing(gen.iterate(tm, plan.reqs)) as results:
        async for _, result in results:
            if not started:  # the first output: a token exists and the prompt's cache hits are known
                started = True
                message = MessageResponse(id=message_id, content=[], model=model, stop_reason=None,
                                          usage=translate.usage(result))
                yield event("message_start", {"message": message.model_dump()})
                yield event("ping", {})
            final = result.finish_reason is not None
            parts = reply.feed(result.text, final=final)
            # The reasoning comes first. A call already open continues before any new text (text
            # after a call comes once it is closed); calls that start in this piece come after the
            # text before them.
            events = blocks.thinking(parts.reasoning)
            events += [e for c in parts.calls if "id" not in c for e in blocks.call(c)] + blocks.text(parts.content)
            events += [e for c in parts.calls if "id" in c for e in blocks.call(c)]
            for item in events:
                yield item
            if final:
                reason, sequence = translate.stop_reason(result, reply.called, stop_sequences)
                for item in blocks.close():
                    yield item
                yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": translate.usage(result).model_dump()})
                yield event("message_stop", {})
