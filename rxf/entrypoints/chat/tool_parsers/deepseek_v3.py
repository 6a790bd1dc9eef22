"""DeepSeek-V3's format: plain text, then a block of calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`, each between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`:

- V3 / R1: `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` (the arguments in a JSON code block);
- V3.1 and later: `NAME<｜tool▁sep｜>{...}`.

The arguments stream as they are written (their JSON text, as `json_scan` finds its end)."""

from __future__ import annotations

from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.json_scan import CallScan, skip_ws, value_end
from rxf.plugins.chat_templates.tools import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    DeepSeekV3Syntax,
)

_FENCE = "```json"


def _arguments(body: str, i: int) -> str:
    """The arguments' JSON text (so far) from `body[i]` on."""
    i = skip_ws(body, i)
    end = value_end(body, i)
    return body[i : len(body) if end is None else end]


def _call(body: str) -> CallScan:
    """The call in the text after a `<｜tool▁call▁begin｜>` (up to its end marker, if it came)."""
    sep = body.find(DS_SEP)
    if sep == -1:
        return CallScan(valid="\n" not in body)  # a name (or "function") is arriving
    head, rest = body[:sep].strip(), body[sep + len(DS_SEP) :]
    if head != "function":  # V3.1: the name, then the arguments
        return CallScan(name=head, arguments=_arguments(rest, 0)) if head else CallScan(valid=False)
    newline = rest.find("\n")
    if newline == -1:  # the name is still arriving
        return CallScan()
    name = rest[:newline].strip()
    fence = skip_ws(rest, newline)
    if _FENCE.startswith(rest[fence:]):  # the code block's fence is still arriving
        return CallScan(name=name)
    # Arguments in their code block, or (leniently) written bare.
    start = fence + len(_FENCE) if rest.startswith(_FENCE, fence) else fence
    return CallScan(name=name, arguments=_arguments(rest, start))


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseek_v3"
    markers = (DS_CALLS_BEGIN,)
    syntax = DeepSeekV3Syntax()

    def pieces(self, text: str) -> list[Piece]:
        start = text.find(DS_CALLS_BEGIN)
        if start == -1:
            return [text]
        pieces: list[Piece] = [text[:start]]
        i = start + len(DS_CALLS_BEGIN)
        while True:
            i = skip_ws(text, i)
            if text.startswith(DS_CALLS_END, i):
                return [*pieces, text[i + len(DS_CALLS_END) :]]
            if not text.startswith(DS_CALL_BEGIN, i):
                # The end of the text may still become a marker: wait; anything else is text.
                rest = text[i:]
                if DS_CALL_BEGIN.startswith(rest) or DS_CALLS_END.startswith(rest):
                    return pieces
                return [*pieces, rest]
            body_start = i + len(DS_CALL_BEGIN)
            end = text.find(DS_CALL_END, body_start)
            call = _call(text[body_start : len(text) if end == -1 else end])
            if end == -1:
                return [*pieces, CallPiece(call, text[i:], closed=False)]
            if call.name is not None and not call.arguments:
                call.arguments = "{}"
            pieces.append(CallPiece(call, text[i : end + len(DS_CALL_END)], closed=True))
            i = end + len(DS_CALL_END)
