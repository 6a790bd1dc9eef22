"""Reasoning parsers: a thinking model's output text -> its reasoning and the reply after it.

`split(text, final, inside)` must be prefix-stable, as the tool-call parsers' `scan` is: while the
text grows (`final` False) the reasoning and the content only ever extend, so a stream sends the
difference between successive splits and the deltas add up to `split(whole, final=True)`, which is
what a non-streamed response holds. Text that may still turn out to be a marker (a prefix of one at
the end) is held back until it is known.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output holds no reasoning at all
    content: str


class ReasoningParser(ABC):
    """Reads one way of marking reasoning. Subclasses set `name` (the `model.reasoning_parser`
    value) and `markers` (their start, at the end of the text, is held back)."""

    name: str = ""
    markers: tuple[str, ...] = ()
    # The text that ends the reasoning of output that starts inside it, when there is one: a
    # constraint (response_format, forced tool calls) then starts after it (`grammar_after`).
    end_marker: str | None = None
    # The markers are special tokens, so the output must be detokenized with them.
    needs_special_tokens: bool = False

    @abstractmethod
    def starts_inside(self, prompt: str) -> bool:
        """Whether output that follows `prompt` (the rendered chat) begins inside the reasoning:
        a template may open the block itself (DeepSeek-R1's writes `<think>\\n`)."""

    @abstractmethod
    def split(self, text: str, *, final: bool, inside: bool) -> ReasoningSplit:
        """The reasoning and content of `text`; `inside` as `starts_inside` said for its prompt."""

    def held_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that begins a marker (held back while streaming)."""
        for k in range(min(max(map(len, self.markers), default=0), len(text)), 0, -1):
            if any(marker.startswith(text[-k:]) for marker in self.markers):
                return k
        return 0
