"""Which waiting requests join the next prefill, each reserved in full (prefix locked, row and slots
taken) or not at all.

The seeds' rule: available = free + evictable - sum over running requests of
(remaining max_new_tokens x new_token_ratio). A request fits if its uncached prompt plus its own
future tokens fit in what is left. Its matched prefix is locked before it is counted (a locked
prefix stops being evictable, so locking can shrink `available`) and released if it then no
longer fits.

A chunked prompt's later chunks are counted in full, for the requests admitted and for the
running ones between chunks: they are owed, not estimated. Counting only the first chunk let
more prompts start than the pool could finish, and once their next chunks found no slots none of
them could progress (nothing decodes to free any): the engine stalled for good.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rxf.core.kvcache.kv_manager import KVManager
from rxf.core.scheduler.req import Req

# Future tokens of a request (new or running) are counted in full, but never more than this: a
# request asking for a huge max_new_tokens would otherwise block admission long before it could use
# the space (one client's max_new_tokens = 10**9 would stall every other client). A request that
# does outgrow the estimate is retracted when decode runs out of slots.
MAX_NEW_TOKENS_ESTIMATE = 4096


def _future_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens, MAX_NEW_TOKENS_ESTIMATE)


def _prompt_left(req: Req) -> int:
    """Prompt tokens of a running request that no step has taken yet (its later chunks)."""
    return 0 if req.decoding else req.seq_len - req.kv_len


@dataclass
class Admission:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    new_tokens: int = 0


def admit(
    ordered: list[Req],
    running: list[Req],
    kv: KVManager,
    *,
    new_token_ratio: float,
    max_prefill_tokens: int,
    chunk_size: int | None,
    batch_nonempty: bool = False,
) -> Admission:
    """Reserve and return the requests to prefill now (`Req.kv` set: prefix locked, row and their
    first `extend_lens[i]` slots taken).

    A request longer than the chunk size is admitted with only its first chunk; a prompt longer
    than `max_prefill_tokens` is still admitted when it is the batch's first, so it cannot starve.
    """

    def available() -> float:
        return kv.available() - sum(_prompt_left(r) + _future_tokens(r) * new_token_ratio for r in running)

    out = Admission()
    futures = 0.0  # tokens owed to the requests admitted so far: later chunks, future tokens
    for req in ordered:
        if kv.free_rows() == 0:
            break
        limit = req.prompt_logits_from() if req.wants_prompt_logprobs() else None
        res = kv.reserve(req, limit)
        extend_len = req.seq_len - res.prefix_len
        if chunk_size is not None and not req.wants_prompt_logprobs():
            extend_len = req.chunk_len(res.prefix_len, min(extend_len, chunk_size))
        rest = req.seq_len - res.prefix_len - extend_len  # its later chunks
        future = _future_tokens(req)
        # With nothing else running, the first request only needs room for its prompt: waiting
        # for room it can never get would stall the queue (it may later end "length" if it outgrows
        # the cache).
        if not running and not out.reqs and not batch_nonempty:
            future = 0
        too_many = bool(out.reqs or batch_nonempty) and out.new_tokens + extend_len > max_prefill_tokens
        # `available()` counts the prefix as locked now.
        if too_many or futures + extend_len + rest + future > available():
            res.cancel()
            break
        if not res.allocate(extend_len):  # eviction freed less than counted on (it cancelled)
            break
        out.reqs.append(req)
        out.extend_lens.append(extend_len)
        out.new_tokens += extend_len
        futures += rest + future
    return out
