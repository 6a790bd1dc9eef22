"""Request bodies must hold valid Unicode text: JSON can escape a lone UTF-16 surrogate ("\\ud800"),
which Python's `json` decodes into a str that no UTF-8 encoder (tokenizer, grammar compiler, cache
hash, our own JSON responses) accepts. Such a body is refused up front, naming the field.
"""

from __future__ import annotations

from typing import Any


class InvalidTextError(ValueError):
    """A string of the body is not valid Unicode; `param` is where it is (`messages[0].content`)."""

    def __init__(self, param: str, position: int) -> None:
        super().__init__(
            f"{param or 'the request body'}: a string holds a lone UTF-16 surrogate (at character "
            f"{position}), which is not valid Unicode"
        )
        self.param = param


def _child(path: str, key: Any) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))


def check_unicode(value: Any) -> None:
    """Raises InvalidTextError for the first string (or object key) in `value`, a decoded JSON
    value, that cannot be encoded as UTF-8. Iterative: a body may nest as deep as the JSON parser
    allows."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise InvalidTextError(path, e.start) from None
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((child, _child(path, key)))
                stack.append((key, path))
        elif isinstance(item, list):
            stack.extend((child, _child(path, i)) for i, child in reversed(list(enumerate(item))))
