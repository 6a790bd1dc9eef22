"""Scanning JSON text while a model is still writing it: where values end, and what a tool-call
object (`{"name": ..., "arguments": {...}}`) says so far.

Every result is prefix-stable: what is found in a text is found again, unchanged, in any longer
text that starts with it. That is what lets a stream send a call's name and argument fragments
as soon as they appear and have them add up to what the whole text parses to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI's and Llama 3's names


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at `text[i]`; None if the text ends first."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at `text[i]`; None if the text ends first.
    Only strings and brackets are tracked; `json.loads` judges the value once it is whole."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            char = text[j]
            if char == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: up to the next delimiter (the text may still extend it)
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


@dataclass
class CallScan:
    """A call object read so far. `arguments` is the raw JSON text of its arguments value (a prefix
    of it while open; "{}" once the object closes without one); `end` is the index after its
    closing brace (None while open); `valid` is False once the text is no call object."""

    name: str | None = None
    arguments: str = ""
    end: int | None = None
    valid: bool = True


def scan_call(text: str, i: int) -> CallScan:
    """Read the call object that starts at `text[i]` (after optional whitespace)."""
    call = CallScan()
    i = skip_ws(text, i)
    if i == len(text):
        return call
    if text[i] != "{":
        call.valid = False
        return call
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j == len(text):
            return call
        if text[j] == "}":
            call.end = j + 1
            call.arguments = call.arguments or "{}"
            return call
        if text[j] == ",":
            j += 1
            continue
        key_end = string_end(text, j) if text[j] == '"' else None
        if text[j] != '"' or key_end is None:
            call.valid = text[j] == '"'  # an unfinished key is still fine
            return call
        key = _decode(text[j:key_end])
        j = skip_ws(text, key_end)
        if j == len(text):
            return call
        if text[j] != ":":
            call.valid = False
            return call
        start = skip_ws(text, j + 1)
        end = value_end(text, start)
        if key in NAME_KEYS and call.name is None:
            if start < len(text) and text[start] != '"':
                call.valid = False
                return call
            if end is None:
                return call
            name = _decode(text[start:end])
            if not isinstance(name, str):
                call.valid = False
                return call
            call.name = name
        elif key in ARGUMENT_KEYS and not call.arguments:
            call.arguments = text[start : len(text) if end is None else end]
        if end is None:
            return call
        j = end


def _decode(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
