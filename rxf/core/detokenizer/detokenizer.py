"""Incremental detokenization: the scheduler's token ids (`BatchTokenOut`) become text deltas
(`BatchStrOut`) for the TokenizerManager (`rxf.core.detokenizer.process` runs it). Two layers per
request:

- `DecodeState` turns token ids into *confirmed* text with two offsets, so each step decodes only a
  small window instead of the whole output, and never confirms half a multi-byte character.
- `DetokState` decides how much of the confirmed text the client may see: while the request runs it
  holds back any tail that could still become a stop string, and when the request ends on a stop
  string it cuts the text there (unless `no_stop_trim`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rxf.core.ipc.messages import BatchStrOut, BatchTokenOut, FinishReason, StrOut, TokenOut

logger = logging.getLogger(__name__)

# What a lossy UTF-8 decode yields for an incomplete byte sequence at the end of the text.
REPLACEMENT_CHAR = "\ufffd"

# (sequences, skip_special_tokens, spaces_between_special_tokens) -> one text per sequence.
BatchDecodeFn = Callable[[list[list[int]], bool, bool], list[str]]


@dataclass
class DecodeState:
    """Incremental decode of one request's output ids.

    The offsets split `ids` in three:
      ids[:surr_offset]             confirmed; never decoded again
      ids[surr_offset:read_offset]  confirmed, kept as context: tokenizers that strip a leading
                                    space or merge bytes need a neighbour to decode a token right
      ids[read_offset:]             not confirmed yet (new, or ending in half a character)
    Each step decodes the context window and the context+pending window; the difference is the new
    text. Invariants (byte-level tokenizers): `text` is the decode of ids[:read_offset] and never
    ends in half a character; the windows stay a few tokens long however long the output grows
    (only a run of tokens that decode to nothing, or to unfinished bytes, keeps them open).
    """

    ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def has_pending(self) -> bool:
        return self.read_offset < len(self.ids)

    def windows(self) -> tuple[list[int], list[int]]:
        """The two windows to decode: (context, context + pending)."""
        return self.ids[self.surr_offset : self.read_offset], self.ids[self.surr_offset :]

    def advance(self, surr_text: str, full_text: str, *, finished: bool) -> str:
        """Take the decoded `windows()` and return the newly confirmed text ("" if none yet).

        Pending text that is empty or ends in U+FFFD stays pending (the next tokens may complete the
        character, or give an empty token's neighbour); on the finished step everything is flushed.
        For byte-level tokenizers `surr_text` is a prefix of `full_text`: the context window starts
        and ends on character boundaries because it was confirmed.
        """
        new_text = full_text[len(surr_text) :]
        if not finished and (not new_text or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self.text += new_text
        self.surr_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text

    def step(
        self,
        tokenizer: Any,
        new_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        finished: bool = False,
    ) -> str:
        """Append `new_ids` and return the newly confirmed text (one request, unbatched)."""
        self.ids.extend(new_ids)
        if not self.has_pending() or not (new_ids or finished):
            return ""
        kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        surr_ids, full_ids = self.windows()
        surr_text = tokenizer.decode(surr_ids, **kwargs)
        full_text = tokenizer.decode(full_ids, **kwargs)
        return self.advance(surr_text, full_text, finished=finished)


@dataclass
class DetokState:
    """One request: its `DecodeState` plus how much of the confirmed text the client was sent.

    Invariant: decode.text[:sent] has been emitted and no occurrence of a stop string, whole or
    partial, starts before `sent` (such a tail is held back), so a stop string is found by searching
    from `sent` and a client never sees part of a stop string that is later trimmed.
    """

    decode: DecodeState = field(default_factory=DecodeState)
    sent: int = 0

    def emit(self, out: TokenOut) -> str:
        """The delta to send for `out`, after `decode` has taken `out.new_token_ids`."""
        text = self.decode.text
        if out.finished is not None:
            end = _finish_end(text, self.sent, out.finished, out.no_stop_trim)
        elif out.no_stop_trim:
            # The stop string will be shown anyway: nothing to hold back.
            end = len(text)
        else:
            end = _safe_end(text, self.sent, out.stop)
        delta = text[self.sent : end]
        self.sent = end
        return delta


def _safe_end(text: str, start: int, stops: Sequence[str]) -> int:
    """End of the part of `text` that can be shown while the request runs: before the first
    complete stop string (the scheduler is about to finish on it) and before any tail that is a
    proper prefix of a stop string. Only text[start:] is searched, so the cost is bounded."""
    end = len(text)
    if end == start:
        return end
    last = text[-1]
    for stop in stops:
        if not stop:
            continue
        found = text.find(stop, start)
        if found != -1:
            end = min(end, found)
            continue
        # Longest k with text ending in stop[:k]; only k where stop[k - 1] == last can match.
        k = min(len(stop) - 1, len(text) - start)
        while k > 0:
            k = stop.rfind(last, 0, k) + 1
            if k and text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
            k -= 1
    return end


def _finish_end(text: str, start: int, finished: FinishReason, no_stop_trim: bool) -> int:
    """End of the final text: cut before the matched stop string unless asked to keep it."""
    matched = finished.matched
    if no_stop_trim or not isinstance(matched, str) or not matched:
        return len(text)
    # An occurrence may overlap text already sent only if the stop list was not sent with earlier
    # outputs; then cut at what was sent, since sent text cannot be taken back.
    found = text.find(matched, max(start - len(matched) + 1, 0))
    return len(text) if found == -1 else max(found, start)


def make_batch_decoder(tokenizer: Any) -> BatchDecodeFn:
    """A batched decode with exactly `tokenizer.decode`'s results.

    For a plain fast tokenizer whose decode adds nothing to the Rust one (no clean-up pass, no
    override), one Rust `decode_batch` call. Otherwise one `decode` call per sequence: measured
    with transformers 5, its `batch_decode` is a Python loop over `decode` and, converting the
    nested lists first, about 2x slower than calling `decode` directly.
    """
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # a tokenizer from elsewhere: only its own decode is known
        PreTrainedTokenizerFast = None  # noqa: N806
    cls = type(tokenizer)
    if (
        PreTrainedTokenizerFast is not None
        and isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        backend = tokenizer.backend_tokenizer

        def rust_decode(seqs: list[list[int]], skip: bool, _spaces: bool) -> list[str]:
            # spaces_between_special_tokens only affects slow (Python) tokenizers.
            return backend.decode_batch(seqs, skip_special_tokens=skip)

        return rust_decode

    def decode_each(seqs: list[list[int]], skip: bool, spaces: bool) -> list[str]:
        return [
            tokenizer.decode(seq, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            for seq in seqs
        ]

    return decode_each


class Detokenizer:
    """Turns the scheduler's token batches into text batches; keeps per-request state by rid and
    drops it when the request finishes. The windows of all requests that share decode flags are
    decoded in one batched call."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode_batch = make_batch_decoder(tokenizer)
        self._states: dict[str, DetokState] = {}

    @property
    def num_active(self) -> int:
        return len(self._states)

    def handle(self, batch: BatchTokenOut) -> BatchStrOut:
        results: list[StrOut] = []
        group: list[TokenOut] = []
        rids: set[str] = set()
        for out in batch.outs:
            # A request twice in one batch: its earlier tokens must be decoded first.
            if out.rid in rids:
                results.extend(self._handle_distinct(group))
                group, rids = [], set()
            group.append(out)
            rids.add(out.rid)
        results.extend(self._handle_distinct(group))
        return BatchStrOut(outs=results)

    def _handle_distinct(self, outs: list[TokenOut]) -> list[StrOut]:
        """Handle outputs of distinct requests, in order."""
        states: list[DetokState] = []
        by_flags: dict[tuple[bool, bool], list[int]] = {}
        for i, out in enumerate(outs):
            state = self._states.get(out.rid)
            if state is None:
                state = self._states[out.rid] = DetokState()
            states.append(state)
            state.decode.ids.extend(out.new_token_ids)
            if state.decode.has_pending() and (out.new_token_ids or out.finished is not None):
                flags = (out.skip_special_tokens, out.spaces_between_special_tokens)
                by_flags.setdefault(flags, []).append(i)

        for (skip, spaces), idxs in by_flags.items():
            seqs: list[list[int]] = []
            for i in idxs:
                seqs.extend(states[i].decode.windows())
            texts = self._decode_batch(seqs, skip, spaces)
            for j, i in enumerate(idxs):
                states[i].decode.advance(
                    texts[2 * j], texts[2 * j + 1], finished=outs[i].finished is not None
                )

        results = []
        for out, state in zip(outs, states, strict=True):
            results.append(StrOut(token=out, text_delta=state.emit(out)))
            if out.finished is not None:
                del self._states[out.rid]
        return results
