"""Llama 3.1+ JSON format: the whole reply is `{"name": ..., "parameters": {...}}` (several joined
by ";"), optionally after `<|python_tag|>`. A reply that starts otherwise is plain text."""

from __future__ import annotations

from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.json_scan import scan_call, skip_ws
from rxf.plugins.chat_templates.tools import Llama3JsonSyntax

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    syntax = Llama3JsonSyntax()

    def pieces(self, text: str) -> list[Piece]:
        i = skip_ws(text, 0)
        lead = text[:i]
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        if i == len(text) or text[i] != "{":
            return [text]
        pieces: list[Piece] = [lead]
        while True:
            call = scan_call(text, i)
            if call.end is None:
                return [*pieces, CallPiece(call, text[i:], closed=False)]
            pieces.append(CallPiece(call, text[i : call.end], closed=True))
            j = skip_ws(text, call.end)
            if not text.startswith(";", j):
                return [*pieces, text[call.end :]]
            i = skip_ws(text, j + 1)
            if i == len(text):  # the separator is not content; another call may follow it
                return [*pieces, text[call.end : j]]
            if text[i] != "{":
                return [*pieces, text[call.end :]]
