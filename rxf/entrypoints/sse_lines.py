"""JSON on server-sent events' `data:` lines, whole to every line reader.

SSE ends a line at CR or LF only, and JSON escapes both inside strings. But clients that split a
stream with Python's `str.splitlines` (httpx's `iter_lines`, for one) also break at U+0085, U+2028 and
U+2029, which JSON leaves raw inside strings, and generated text can hold them: such a reader got the
event cut in two (tests/reliability/test_health_and_drain.py failed that way on 2026-12-06). Every rxf
stream writes them as `\\u0085`, `\\u2028`, `\\u2029` instead: the same JSON value.
"""

from __future__ import annotations

_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def data_json(json_text: str) -> str:
    """`json_text` (a JSON document) with the line breaks above escaped; these characters can only
    occur inside its strings, where an escape means the same character."""
    return json_text.translate(_LINE_BREAKS)
