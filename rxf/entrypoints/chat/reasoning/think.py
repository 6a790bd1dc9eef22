"""`<think>...</think>` reasoning (Qwen3, QwQ, DeepSeek-R1 and its distills): the block comes first,
the reply after it. DeepSeek-R1's template opens the block in the prompt, so its output starts inside
(and ends it with `</think>` only); Qwen3's model opens it itself, or its template writes an empty
block when `enable_thinking` is false."""

from __future__ import annotations

from rxf.entrypoints.chat.reasoning.base import ReasoningParser, ReasoningSplit

OPEN, CLOSE = "<think>", "</think>"
_WHITESPACE = " \t\r\n"


class ThinkParser(ReasoningParser):
    name = "think"
    markers = (OPEN, CLOSE)
    end_marker = CLOSE

    def starts_inside(self, prompt: str) -> bool:
        return prompt.rstrip(_WHITESPACE).endswith(OPEN)

    def split(self, text: str, *, final: bool, inside: bool) -> ReasoningSplit:
        rest = text.lstrip(_WHITESPACE)
        if rest.startswith(OPEN):
            body = rest[len(OPEN) :]
        elif not final and OPEN.startswith(rest):  # may still become the opening marker
            return ReasoningSplit("" if inside else None, "")
        elif inside:
            body = text
        else:  # no block: the model did not think
            return ReasoningSplit(None, text)
        reasoning, closed, after = body.partition(CLOSE)
        if closed:
            return ReasoningSplit(reasoning.strip(_WHITESPACE), after.lstrip(_WHITESPACE))
        if not final:  # a marker may be arriving, and trailing whitespace may end the block
            reasoning = reasoning[: len(reasoning) - self.held_prefix(reasoning)].rstrip(_WHITESPACE)
        # Cut short inside the block (or never closed): all of it is reasoning.
        return ReasoningSplit(reasoning.strip(_WHITESPACE), "")
