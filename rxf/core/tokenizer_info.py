"""Facts about a tokenizer that the front door and the scheduler both bound work by."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for: its longest vocabulary entry (a
    byte-level entry has a character per byte, so it never undercounts the text it decodes to)."""
    return max(map(len, tokenizer.get_vocab()), default=1)
