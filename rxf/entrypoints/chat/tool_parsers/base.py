"""Tool-call parsers: a model's output text -> content and tool calls, whole or streamed.

A parser splits the text into pieces (plain text and call objects, `pieces`); `scan` turns them
into the content and the calls found so far. `scan(text, final=False)` only ever grows as the
text grows (its content and each call's arguments extend, calls are appended), so a stream sends
the difference between successive scans, and the deltas add up to `scan(whole_text, final=True)`,
which is exactly what a non-streamed response holds. To keep that true while text is arriving:
- text that may still become markup (a prefix of a marker at the end) or whitespace that may
  still border a call is held back until it is known (whitespace around calls is dropped; text
  before and after a call is joined by a newline);
- a call is reported once its name is known and stays a call from then on; a call object whose
  name never comes (invalid, or closed without one) is plain text after all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rxf.core.tool_syntax import ToolSyntax
from rxf.entrypoints.chat.tool_parsers.json_scan import CallScan, scan_call, skip_ws


@dataclass
class CallPiece:
    """A call object in the text. `raw` is its text, markup included (what it is as plain text);
    `closed` is True once its end is in the text."""

    call: CallScan
    raw: str
    closed: bool


Piece = str | CallPiece


@dataclass
class ParsedCall:
    name: str
    arguments: str


@dataclass
class Scan:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser(ABC):
    """Reads one format of tool calls. Subclasses set `name` (the `model.tool_call_parser`
    value), `markers` (strings whose start, at the end of the text, is held back) and `syntax`
    (how a chat template without tool support shows tools and calls in this format)."""

    name: str = ""
    markers: tuple[str, ...] = ()
    syntax: ToolSyntax | None = None
    # The format's marker is a special token, so the output must be detokenized with it.
    needs_special_tokens: bool = False

    def __init__(self, hidden: tuple[str, ...] = ()) -> None:
        # Special tokens other than the markers that appear when `needs_special_tokens` holds
        # (EOS, ...): they are not content.
        self.hidden = hidden

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolCallParser:
        """The parser for replies to a request offering `tools` (OpenAI tool entries). A format that
        writes argument values untyped (qwen3_coder's XML) reads them by the tools' schemas; the
        JSON formats need nothing, so by default this is the parser itself."""
        return self

    @abstractmethod
    def pieces(self, text: str) -> list[Piece]:
        """The text in order as plain text and call pieces; the last piece may be unfinished."""

    def scan(self, text: str, final: bool) -> Scan:
        items: list[str | CallScan | None] = []  # None: an unresolved call; nothing after it is known
        for piece in self.pieces(text):
            if isinstance(piece, str):
                items.append(piece)
            elif piece.call.name is not None:
                items.append(piece.call)
            elif final or piece.closed or not piece.call.valid:
                items.append(piece.raw)
            else:
                items.append(None)
                break
        merged: list[str | CallScan | None] = []
        for item in items:
            if isinstance(item, str) and merged and isinstance(merged[-1], str):
                merged[-1] += item
            else:
                merged.append(item)
        scan = Scan("")
        for k, item in enumerate(merged):
            if isinstance(item, CallScan):
                scan.calls.append(ParsedCall(item.name or "", item.arguments))
            elif isinstance(item, str):
                text = self._text(item, after_call=k > 0, before_call=k + 1 < len(merged), final=final)
                if text and k > 0 and scan.content:
                    scan.content += "\n"  # text on both sides of a call stays apart
                scan.content += text
        return scan

    def _text(self, text: str, *, after_call: bool, before_call: bool, final: bool) -> str:
        for hidden in self.hidden:
            text = text.replace(hidden, "")
        if after_call:
            text = text.lstrip()
        if before_call:
            return text.rstrip()
        if not final:
            text = text[: len(text) - self._held_marker_prefix(text)].rstrip()
        return text

    def _held_marker_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that begins a marker (or a hidden token)."""
        longest = 0
        for marker in self.markers + self.hidden:
            for k in range(min(len(marker), len(text)), longest, -1):
                if text.endswith(marker[:k]):
                    longest = k
                    break
        return longest

    def parse(self, text: str) -> Scan:
        """The whole output's content and calls."""
        return self.scan(text, final=True)


def array_pieces(text: str, i: int, read: Callable[[str, int], CallScan] = scan_call) -> list[Piece]:
    """The pieces of a list of calls starting at `text[i]` (after optional whitespace), then of the
    text after the list; `read(text, j)` reads the call at `text[j]` (default: a JSON call object).
    Text that is no such list is plain text."""
    i = skip_ws(text, i)
    if i == len(text):
        return []
    if text[i] != "[":
        return [text[i:]]
    pieces: list[Piece] = []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j == len(text):
            return pieces
        if text[j] == "]":
            return [*pieces, text[j + 1 :]]
        if text[j] == ",":
            j += 1
            continue
        call = read(text, j)
        if not call.valid and call.name is None:
            return [*pieces, text[j:]]
        pieces.append(CallPiece(call, text[j : len(text) if call.end is None else call.end], call.end is not None))
        if call.end is None:
            return pieces
        j = call.end


def tagged_pieces(text: str, open_tag: str, close_tag: str, read: Callable[[str, bool], CallScan]) -> list[Piece]:
    """The pieces of text holding calls in `open_tag`...`close_tag` blocks; `read(body, closed)`
    reads the call in a block's body (so far; `closed` once its close tag came)."""
    pieces: list[Piece] = []
    pos = 0
    while (start := text.find(open_tag, pos)) != -1:
        pieces.append(text[pos:start])
        close = text.find(close_tag, start)
        end = len(text) if close == -1 else close + len(close_tag)
        call = read(text[start + len(open_tag) : len(text) if close == -1 else close], close != -1)
        pieces.append(CallPiece(call, text[start:end], closed=close != -1))
        if close == -1:
            return pieces
        pos = end
    pieces.append(text[pos:])
    return pieces
