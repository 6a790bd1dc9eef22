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


# JSON values that hold no text. A list of only these (token ids) is skipped by one C-level pass.
_NO_TEXT = frozenset({int, float, bool, type(None)})


def _check_str(text: str, path: str, key: Any = None) -> None:
    """`text` is at `path` (or at its `key`, when given: the path is only built for an error)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidTextError(path if key is None else _child(path, key), e.start) from None


def check_unicode(value: Any) -> None:
    """Raises InvalidTextError for a string (or object key) in `value`, a decoded JSON value, that
    cannot be encoded as UTF-8. Iterative: a body may nest as deep as the JSON parser allows. It runs
    on the event loop for every body, so it is kept cheap: strings are checked where they are met, a
    path is built only for a nested container (or an error), and a list holding no text (a million
    token ids) costs one pass over its element types."""
    if isinstance(value, str):
        _check_str(value, "")
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list) and not _NO_TEXT.issuperset(map(type, item)):
            children = enumerate(item)
        else:
            continue
        nested = []
        for key, child in children:
            if isinstance(key, str):
                _check_str(key, path)
            if isinstance(child, str):
                _check_str(child, path, key)
            elif isinstance(child, dict | list):
                nested.append((child, _child(path, key)))
        stack.extend(reversed(nested))  # depth first, in document order
