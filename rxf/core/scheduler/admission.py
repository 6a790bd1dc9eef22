"""Which waiting requests join the next EXTEND batch.

The seeds' rule: available = free + evictable - sum over running requests of
(remaining max_new_tokens x new_token_ratio). A request fits if its uncached prompt plus its own
future tokens fit in what is left. Its matched prefix is locked before it is counted (a locked
prefix stops being evictable, so locking can shrink `available`) and released if it then no
longer fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rxf.core.scheduler.cache_ops import KVCacheManager
from rxf.core.scheduler.req import Req

# Future tokens of a request (new or running) are counted in full, but never more than this: a
# request asking for a huge max_new_tokens would otherwise block admission long before it could use
# the space (one client's max_new_tokens = 10**9 would stall every other client). A request that
# does outgrow the estimate is retracted when decode runs out of slots.
MAX_NEW_TOKENS_ESTIMATE = 4096


def _future_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens, MAX_NEW_TOKENS_ESTIMATE)


@dataclass
class Admission:
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    new_tokens: int = 0


def admit(
    ordered: list[Req],
    running: list[Req],
    kv: KVCacheManager,
    *,
    new_token_ratio: float,
    max_prefill_tokens: int,
    chunk_size: int | None,
    free_rows: int,
    batch_nonempty: bool = False,
) -> Admission:
    """Lock and return the requests to prefill now (their prefixes matched and locked).

    A request longer than the chunk size is admitted with only its first chunk; a prompt longer
    than `max_prefill_tokens` is still admitted when it is the batch's first, so it cannot starve.
    """
    available = kv.available() - sum(_future_tokens(r) * new_token_ratio for r in running)
    out = Admission()
    budget = 0.0
    for req in ordered:
        if len(out.reqs) >= free_rows:
            break
        limit = req.prompt_logits_from() if req.wants_prompt_logprobs() else None
        slots, node = kv.match(req, limit)
        prefix_len = int(slots.numel())
        extend_len = req.seq_len - prefix_len
        if chunk_size is not None and not req.wants_prompt_logprobs():
            extend_len = min(extend_len, chunk_size)
        if (out.reqs or batch_nonempty) and out.new_tokens + extend_len > max_prefill_tokens:
            break
        future = _future_tokens(req)
        # With nothing else running, the first request only needs room for its prompt: waiting
        # for room it can never get would stall the queue (it may later end "length" if it outgrows
        # the cache).
        alone = not running and not out.reqs and not batch_nonempty
        if alone:
            future = 0
        if budget + extend_len + future > available:
            break
        kv.lock(req, slots, node)
        available = kv.available() - sum(_future_tokens(r) * new_token_ratio for r in running)
        if budget + extend_len + future > available:
            kv.unlock(req)
            req.prefix_indices, req.kv_len = slots[:0], 0
            break
        out.reqs.append(req)
        out.extend_lens.append(extend_len)
        out.new_tokens += extend_len
        budget += extend_len + future
    return out
