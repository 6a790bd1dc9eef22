"""Parsers for output that a grammar forced into a tool call (tool_choice "required" or a named
function): no model markup, only JSON. Their output is read as it is written, not through the
model's own format."""

from __future__ import annotations

from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser, array_pieces
from rxf.entrypoints.chat.tool_parsers.json_scan import CallScan


class RequiredCallsParser(ToolCallParser):
    """The output is a JSON list of `{"name": ..., "parameters": {...}}` objects."""

    name = "required"

    def pieces(self, text: str) -> list[Piece]:
        return array_pieces(text, 0)


class NamedCallParser(ToolCallParser):
    """The output is the arguments object of the one function the client named."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def pieces(self, text: str) -> list[Piece]:
        # Surrounding whitespace is no part of the arguments (trailing whitespace is held back
        # while the text may still continue).
        return [CallPiece(CallScan(name=self.function, arguments=text.strip()), text, closed=False)]
