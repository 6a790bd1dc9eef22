"""Pythonic calls (Llama 3.2, Llama 4; vLLM's `pythonic`): the whole reply is a Python list of
calls with keyword arguments and literal values, `[get_weather(city="Paris"), ping()]`, optionally
between `<|python_start|>` and `<|python_end|>`. A reply that starts otherwise, or a list that is no such calls, is plain
text. A call is reported whole, once its closing parenthesis arrives and it parses (Python's own
`ast` reads it), so its arguments come in one delta."""

from __future__ import annotations

import ast
import json
import re

from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.json_scan import CallScan, skip_ws
from rxf.plugins.chat_templates.tools import PythonicSyntax

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL_HEAD = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_NAME_PREFIX = re.compile(r"[A-Za-z_][\w.]*\s*\Z")  # the text ends inside a call's name
_OPENING, _CLOSING = "([{", ")]}"


def _call_end(text: str, i: int) -> int | None:
    """End (exclusive) of the parenthesised call whose `(` is the first bracket at or after `i`;
    None if the text ends first. Python strings (either quote, with escapes) are skipped."""
    depth, j, quote = 0, i, None
    while j < len(text):
        char = text[j]
        if quote is not None:
            if char == "\\":
                j += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _parse_call(source: str) -> CallScan:
    """`name(key=literal, ...)` as a call (its arguments as JSON text), else an invalid scan."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return CallScan(valid=False)
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in arguments:  # **kwargs
            return CallScan(valid=False)
        return CallScan(name=ast.unparse(node.func), arguments=json.dumps(arguments, ensure_ascii=False))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return CallScan(valid=False)


class PythonicParser(ToolCallParser):
    name = "pythonic"
    markers = (PYTHON_START, PYTHON_END)
    syntax = PythonicSyntax()

    def pieces(self, text: str) -> list[Piece]:
        i = skip_ws(text, 0)
        lead = text[:i]
        if text.startswith(PYTHON_START, i):
            i = skip_ws(text, i + len(PYTHON_START))
        if i == len(text) or text[i] != "[":
            return [text]
        pieces: list[Piece] = [lead]
        j = i + 1
        while True:
            j = skip_ws(text, j)
            if j == len(text):
                return pieces
            if text[j] == "]":
                k = skip_ws(text, j + 1)
                after = k + len(PYTHON_END) if text.startswith(PYTHON_END, k) else j + 1
                return [*pieces, text[after:]]
            if text[j] == "," and len(pieces) > 1:
                j += 1
                continue
            head = _CALL_HEAD.match(text, j)
            if head is None:
                if _NAME_PREFIX.match(text, j):  # a name still arriving
                    return [*pieces, CallPiece(CallScan(), text[j:], closed=False)]
                return [text] if len(pieces) == 1 else [*pieces, text[j:]]
            end = _call_end(text, head.end() - 1)
            if end is None:
                return [*pieces, CallPiece(CallScan(), text[j:], closed=False)]
            call = _parse_call(text[j:end])
            if not call.valid:
                return [text] if len(pieces) == 1 else [*pieces, text[j:]]
            call.end = end
            pieces.append(CallPiece(call, text[j:end], closed=True))
            j = end
