"""The n-gram (prompt-lookup) proposer: the tokens that followed the latest earlier occurrence of
the sequence's newest n tokens, longest n first.

Per request an `NgramIndex` maps each n-gram (n in [min_match, max_match]) to the position right
after its latest occurrence. It is updated incrementally: a step indexes only the n-grams that end
at the tokens added since the last one, so proposing costs O((tokens added + k) x max_match) on the
host whatever the context length, and the index holds at most one entry per (position, n).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class NgramIndex:
    """The n-gram index of one request's tokens (prompt + output).

    Invariant: `_last[n]` holds every n-gram ending before position `_indexed` (as the hash of
    `tokens[e - n:e]` -> e, the latest e), so the continuation `tokens[e:]` of an entry is known.
    A hash collision can only propose wrong drafts, which verification rejects.
    """

    def __init__(self, min_match: int, max_match: int) -> None:
        self.sizes = range(max_match, min_match - 1, -1)  # longest first
        self._last: dict[int, dict[int, int]] = {n: {} for n in self.sizes}
        self.tokens: list[int] = []
        self._indexed = 1  # ends e < _indexed are in the index (e = 0 ends no n-gram)

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Catch up with the request's tokens. The newest token is copied again: jump-forward may
        have re-tokenized it (it is the only token that ever changes, and no key holds it)."""
        start = max(len(self.tokens) - 1, 0)
        del self.tokens[start:]
        if start < len(prompt):
            self.tokens += prompt[start:]
        self.tokens += output[max(start - len(prompt), 0) :]

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix; [] when no suffix of at least min_match tokens occurred before."""
        tokens, end = self.tokens, len(self.tokens)
        for e in range(self._indexed, end):  # the n-grams that end before the newest token
            for n in self.sizes:
                if e >= n:
                    self._last[n][hash(tuple(tokens[e - n : e]))] = e
        self._indexed = max(self._indexed, end)
        for n in self.sizes:
            if end >= n:
                pos = self._last[n].get(hash(tuple(tokens[end - n :])))
                if pos is not None:
                    return tokens[pos : pos + k]
        return []
