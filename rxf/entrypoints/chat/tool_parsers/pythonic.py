"""Pythonic calls (Llama 3.2, Llama 4; vLLM's `pythonic`): the whole reply is a Python list of
calls with keyword arguments and literal values, `[get_weather(city="Paris"), ping()]`, optionally
between `<|python_start|>` and `<|python_end|>`. A reply that starts otherwise, or a list that is no such calls, is plain
text. A call is reported whole, once its closing parenthesis arrives and it parses (Python's own
`ast` reads it), so its arguments come in one delta."""

from __future__ import annotations

import ast
import json
import re

from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser, array_pieces
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


def _read_call(text: str, j: int) -> CallScan:
    """The call at `text[j]`: pending (no name, valid) until its parenthesis closes, then whole."""
    head = _CALL_HEAD.match(text, j)
    if head is None:
        return CallScan(valid=_NAME_PREFIX.match(text, j) is not None)  # valid: a name still arriving
    end = _call_end(text, head.end() - 1)
    if end is None:
        return CallScan()
    call = _parse_call(text[j:end])
    call.end = end if call.valid else None
    return call


class PythonicParser(ToolCallParser):
    name = "pythonic"
    markers = (PYTHON_START, PYTHON_END)
    syntax = PythonicSyntax()

    def pieces(self, text: str) -> list[Piece]:
        lead = text[: skip_ws(text, 0)]
        i = len(lead) + len(PYTHON_START) if text.startswith(PYTHON_START, len(lead)) else len(lead)
        found = array_pieces(text, i, _read_call)
        if not found:  # nothing after the list's opening (or the tag) yet
            return [lead]
        if not any(isinstance(piece, CallPiece) for piece in found):  # no list of calls: plain text
            return [text]
        if isinstance(found[-1], str):  # the text after the list, without its closing tag
            rest = found[-1]
            k = skip_ws(rest, 0)
            found[-1] = rest[k + len(PYTHON_END) :] if rest.startswith(PYTHON_END, k) else rest
        return [lead, *found]
