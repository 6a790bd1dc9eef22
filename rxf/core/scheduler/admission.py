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

A request that shares more than `SHARED_PREFIX_WAIT` uncached tokens with a prompt being computed
(a running request's unfinished prompt, or one admitted to this batch) waits: once that prompt's
KV is in the tree (after each chunk's step) it matches there and computes only the rest, where
admitting it now would compute the shared tokens twice. 16 requests of 4 system prompts arriving
at once (17,424 prompt tokens) computed 3,088 with the wait and 5,136 without at chunks of 4,096
tokens, 3,088 and 3,440 at the CPU's default chunks of 256 (benchmarks/RESULTS.md, "the shared-prefix
wait measured again").
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

# Shared uncached tokens above which a request waits for the prompt it shares them with (SGLang's
# in-batch prefix caching uses the same bound): the wait costs it about one step, while admitting
# it computes the shared tokens again in the same steps.
SHARED_PREFIX_WAIT = 32


def _future_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens, MAX_NEW_TOKENS_ESTIMATE)


def _computing_prompt(req: Req) -> bool:
    """Whether the running request's prompt is not all in the tree yet (its KV is cached after each
    resolved chunk, the last one included)."""
    return req.cached_len < len(req.origin_input_ids)


def _waits_for(req: Req, cached_len: int, computing: list[Req]) -> bool:
    """Whether `req`'s first `cached_len + SHARED_PREFIX_WAIT + 1` tokens (beyond what the tree
    gave it) are the first prompt tokens of a request in `computing` with the same cache salt."""
    n = cached_len + SHARED_PREFIX_WAIT + 1
    if req.known_len < n:
        return False
    ids = req.fill_ids[:n]
    salt = req.options.cache_salt
    return any(
        len(other.origin_input_ids) >= n
        and other.origin_input_ids[n - 1] == ids[n - 1]  # cheap first: most pairs differ here
        and other.options.cache_salt == salt
        and other.origin_input_ids[:n] == ids
        for other in computing
    )


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

    `max_prefill_tokens`: the prompt tokens the step may still take. With chunking, a request is
    admitted with what fits of its prompt (at most `chunk_size`), its next chunks following in later
    steps; without, a prompt longer than what is left is still admitted when it is the batch's
    first, so it cannot starve.
    """

    def available() -> float:
        return kv.available() - sum(_prompt_left(r) + _future_tokens(r) * new_token_ratio for r in running)

    out = Admission()
    computing = [r for r in running if _computing_prompt(r)]  # prompts a request may share a prefix with
    futures = 0.0  # tokens owed to the requests admitted so far: later chunks, future tokens
    for req in ordered:
        room = max_prefill_tokens - out.new_tokens
        if kv.free_rows() == 0 or (room <= 0 and (out.reqs or batch_nonempty)):
            break
        limit = req.prompt_logits_from() if req.wants_prompt_logprobs() else None
        res = kv.reserve(req, limit)
        if not kv.tree.disable and limit is None and _waits_for(req, res.prefix_len, computing):
            res.cancel()
            continue
        extend_len = req.seq_len - res.prefix_len
        if chunk_size is not None and not req.wants_prompt_logprobs():
            extend_len = req.chunk_len(res.prefix_len, min(extend_len, chunk_size, max(room, 1)))
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
        computing.append(req)
    return out
