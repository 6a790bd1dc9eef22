"""Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with
plain text around them."""

from __future__ import annotations

from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.json_scan import scan_call
from rxf.plugins.chat_templates.tools import HermesSyntax

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = (OPEN,)
    syntax = HermesSyntax()

    def pieces(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(OPEN, pos)) != -1:
            pieces.append(text[pos:start])
            body = start + len(OPEN)
            close = text.find(CLOSE, body)
            end = len(text) if close == -1 else close + len(CLOSE)
            call = scan_call(text[: len(text) if close == -1 else close], body)
            pieces.append(CallPiece(call, text[start:end], closed=close != -1))
            if close == -1:
                return pieces
            pos = end
        pieces.append(text[pos:])
        return pieces
