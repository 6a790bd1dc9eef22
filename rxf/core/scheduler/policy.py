"""Ordering of the waiting queue before admission."""

from __future__ import annotations

import random

from rxf.core.kvcache.kv_manager import KVManager
from rxf.core.scheduler.req import Req


def order_waiting(waiting: list[Req], policy: str, kv: KVManager, rng: random.Random) -> list[Req]:
    """Return the queue in admission order.

    `lpm` (longest prefix match, the default) puts requests that reuse the most cached KV first,
    so shared prefixes are computed once and stay hot; ties keep arrival order. Matching here is
    only for ordering: admission matches again, after locking, because an eviction in between
    may shorten a match.

    `priority` puts lower `Req.options.priority` values first (vLLM's convention), ties by arrival. Its
    key holds only request data, so every tensor-parallel rank, given the same requests, picks
    the same order.
    """
    if policy == "fcfs":
        return list(waiting)
    if policy == "random":
        out = list(waiting)
        rng.shuffle(out)
        return out
    if policy == "lpm":
        if kv.tree.disable or len(waiting) > 128:  # matching is O(queue x prompt): cap its cost
            return list(waiting)
        lengths = {id(r): kv.match_len(r) for r in waiting}
        return sorted(waiting, key=lambda r: -lengths[id(r)])
    if policy == "priority":
        return sorted(waiting, key=lambda r: (r.options.priority, r.arrival))
    raise ValueError(f"scheduler.policy: unknown policy {policy!r} (lpm, fcfs, random, priority)")
