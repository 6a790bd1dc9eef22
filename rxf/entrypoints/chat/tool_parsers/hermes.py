"""Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with
plain text around them."""

from __future__ import annotations

from rxf.entrypoints.chat.tool_parsers.base import Piece, ToolCallParser, tagged_pieces
from rxf.entrypoints.chat.tool_parsers.json_scan import scan_call
from rxf.plugins.chat_templates.tools import HermesSyntax

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = (OPEN,)
    syntax = HermesSyntax()

    def pieces(self, text: str) -> list[Piece]:
        return tagged_pieces(text, OPEN, CLOSE, lambda body, _closed: scan_call(body, 0))
