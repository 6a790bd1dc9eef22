"""Mistral format: text, then `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": ...}`.
`[TOOL_CALLS]` is a special token in Mistral's tokenizers, so the output keeps special tokens."""

from __future__ import annotations

from rxf.entrypoints.chat.tool_parsers.base import Piece, ToolCallParser, array_pieces
from rxf.plugins.chat_templates.tools import MistralSyntax

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = (MARKER,)
    syntax = MistralSyntax()
    needs_special_tokens = True

    def pieces(self, text: str) -> list[Piece]:
        start = text.find(MARKER)
        if start == -1:
            return [text]
        return [text[:start], *array_pieces(text, start + len(MARKER))]
