"""Client input quoted in error messages, bounded: an error names what it refuses, but a 1 MB field
(a role, a request id, a 400-digit number, a URL) must not come back as a 1 MB error."""

from __future__ import annotations

from typing import Any

# The most characters of one quoted value; what is cut is replaced by a marker with the full length.
MAX_ECHO_CHARS = 80


def cut(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text`, or its first `limit` characters and a marker saying how many there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text)} characters]"


def echo(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters (`cut`); of a long
    string only the head is quoted, so its full repr is never built."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}...[{len(value)} characters]"
    return cut(repr(value), limit)
