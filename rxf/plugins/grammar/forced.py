"""A grammar's forced continuation, found from the token bitmask one byte at a time, up to a bound.

xgrammar's own `find_jump_forward_string()` takes no bound and never returns for a grammar whose
forced continuation is infinite (`{"a": {"$ref": "#"}}` forces `{"a":{"a":...`), growing memory
until the process dies; a huge finite one (`minItems: 100000000` of a const) does the same. Every
constraint comes from a client, so the scheduler never calls it.

Instead: byte b is forced at the matcher's position exactly when every allowed token starts with b
and no stop token is allowed. That is read off the next-token bitmask with one AND against the set
of tokens starting with b (precomputed per byte value). The byte is then accepted (`accept_string`)
and the test repeated, at most `max_bytes` times; the matcher is rolled back before returning, so
the cost is bounded by `max_bytes` bitmask fills (measured on the demo model's 49k vocabulary:
7-8 us per forced byte, against 57 ms for a decode step; `benchmarks/bench_grammar_limits.py`).
Where the vocabulary has a token for every allowed byte (byte-level and byte-fallback
vocabularies) this is exactly the grammar's forced text; a byte no token can start is not a choice
the model has either.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import xgrammar as xgr


class FirstByteTable:
    """For each byte value b, the bitmask words of the tokens that do NOT start with b (ANDed with an
    allowed-token bitmask, it is zero exactly when every allowed token starts with b)."""

    def __init__(self, info: xgr.TokenizerInfo, vocab_size: int) -> None:
        words = xgr.allocate_token_bitmask(1, vocab_size).shape[1]
        first = np.full(words * 32, -1, dtype=np.int16)  # -1: a token with no bytes (special, padding)
        for token_id, data in enumerate(info.decoded_vocab[:vocab_size]):
            if data:
                first[token_id] = data[0]
        first[list(info.special_token_ids)] = -1
        ids = np.flatnonzero(first >= 0)
        starts = np.zeros((256, words * 32), dtype=bool)
        starts[first[ids], ids] = True
        self.first_byte = first
        self.others = ~np.packbits(starts, axis=1, bitorder="little").view(np.int32)


def forced_string(
    matcher: xgr.GrammarMatcher,
    table: FirstByteTable,
    scratch: torch.Tensor,
    stop_ids: list[int],
    max_bytes: int,
    budget_s: float,
) -> str:
    """The forced text at `matcher`'s position, at most `max_bytes` bytes of it and what `budget_s`
    seconds find (a byte of an ambiguous grammar can cost milliseconds), cut to whole UTF-8
    characters ("" when it starts inside a character). `scratch` is a 1-row bitmask; the matcher is
    left where it was."""
    words = scratch.numpy()[0]
    forced = bytearray()
    deadline = time.perf_counter() + budget_s
    try:
        while len(forced) < max_bytes and time.perf_counter() < deadline:
            matcher.fill_next_token_bitmask(scratch, 0)
            if any(words[s >> 5] >> (s & 31) & 1 for s in stop_ids):
                break  # the grammar may end here
            nonzero = np.flatnonzero(words)
            if nonzero.size == 0:
                break
            word = int(words[nonzero[0]]) & 0xFFFFFFFF
            byte = int(table.first_byte[nonzero[0] * 32 + (word & -word).bit_length() - 1])
            if byte < 0 or (words & table.others[byte]).any() or not matcher.accept_string(bytes([byte])):
                break
            forced.append(byte)
    finally:
        if forced:
            matcher.rollback(len(forced))  # each accept_string is one rollback step
    return _whole_characters(bytes(forced))


def _whole_characters(data: bytes) -> str:
    if data and 0x80 <= data[0] < 0xC0:  # a continuation byte: the text starts mid-character
        return ""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:  # stops inside a character: keep what precedes it
        return data[: exc.start].decode("utf-8")
