"""gpt-oss's harmony channels as reasoning and content (`rxf.entrypoints.chat.harmony` reads the
messages): `analysis` messages are the reasoning; `final` messages and commentary preambles are
the content; tool calls (messages `to=functions.NAME`) stay in the content as they were written,
for the `harmony` tool-call format to read. Output that is no harmony (no header at its start) is
all content."""

from __future__ import annotations

from rxf.entrypoints.chat.harmony import CHANNEL, is_harmony, read_messages
from rxf.entrypoints.chat.reasoning.base import ReasoningParser, ReasoningSplit


class HarmonyReasoningParser(ReasoningParser):
    name = "harmony"
    markers = (CHANNEL,)
    needs_special_tokens = True

    def starts_inside(self, prompt: str) -> bool:
        return False  # the channel is named by each message's header, not by the prompt

    def split(self, text: str, *, final: bool, inside: bool) -> ReasoningSplit:
        harmony = is_harmony(text)
        if harmony is None and not final:
            return ReasoningSplit(None, "")
        if not harmony:
            return ReasoningSplit(None, text)
        reasoning: list[str] = []
        content: list[str] = []
        for message in read_messages(text, final):
            if message.channel == "analysis":
                reasoning.append(message.body)
            elif message.function is not None:
                content.append(message.raw)
            else:
                content.append(message.body)
        return ReasoningSplit("\n".join(reasoning) if reasoning else None, "\n".join(content))
