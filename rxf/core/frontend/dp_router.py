"""Data-parallel routing in the main process: which replica (scheduler group) gets a request.

Each replica has its own KV cache, so a request runs fastest where its prompt's prefix was computed
before. The router keeps, per replica, an approximate index of the prompts routed there: hashes of
every whole block of `block_size` leading tokens (a chain, so block k's hash covers tokens
[0, (k + 1) * block_size) and the cache salt). A request goes to the replica holding the most
leading blocks of its prompt; with no block anywhere, or a tie, to the replica with the fewest
requests in flight (then the fewest routed so far, so an idle engine alternates).

The index is approximate by design: it does not see the replicas' evictions, and it is bounded
(least recently matched blocks are forgotten first). A wrong guess costs only a cache miss.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import asdict, fields
from typing import Any

from rxf.core.ipc.messages import AdminResult, SchedulerStats


class DpRouter:
    def __init__(self, num_replicas: int, block_size: int = 16, max_blocks_per_replica: int = 1 << 16) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_blocks = max_blocks_per_replica
        self._blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas
        self._replica_of: dict[str, int] = {}

    def _chain(self, ids: list[int], salt: str | None) -> list[bytes]:
        """Hash of each whole leading block of `ids` (block k's hash covers all tokens before it)."""
        h = hashlib.blake2b(digest_size=16)
        h.update((salt or "").encode() + b"\0")
        out = []
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            h.update(b"".join(t.to_bytes(4, "little") for t in ids[end - self.block_size : end]))
            out.append(h.copy().digest())
        return out

    def matched_blocks(self, replica: int, chain: list[bytes]) -> int:
        blocks = self._blocks[replica]
        n = 0
        while n < len(chain) and chain[n] in blocks:
            n += 1
        return n

    def route(self, rid: str, ids: list[int], salt: str | None = None) -> int:
        """Pick the replica for request `rid` and record it (until `finished(rid)`)."""
        chain = self._chain(ids, salt)
        if self.num_replicas == 1:
            replica = 0
        else:
            replica = max(
                range(self.num_replicas),
                key=lambda r: (self.matched_blocks(r, chain), -self.in_flight[r], -self.routed[r], -r),
            )
        blocks = self._blocks[replica]
        for digest in chain:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        self._replica_of[rid] = replica
        return replica

    def replica_of(self, rid: str) -> int | None:
        return self._replica_of.get(rid)

    def finished(self, rid: str) -> None:
        replica = self._replica_of.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def forget_cache(self) -> None:
        """After a flush of every replica's cache: nothing is cached anywhere."""
        for blocks in self._blocks:
            blocks.clear()


def combine_results(results: list[AdminResult]) -> AdminResult:
    if len(results) == 1:
        return results[0]
    failed = [f"replica {d}: {r.message}" for d, r in enumerate(results) if not r.ok]
    return AdminResult(not failed, "; ".join(failed) if failed else results[0].message)


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Counts summed over replicas; the hit rate over all prompts; each replica's own in
    `extra["replicas"]` (in replica order)."""
    if len(stats) == 1:
        return stats[0]
    counts = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(SchedulerStats)
              if f.name not in ("cache_hit_rate", "extra")}
    extra: dict[str, Any] = {}
    for s in stats:
        for key, value in s.extra.items():
            if isinstance(value, (int, float)) and key != "new_token_ratio":
                extra[key] = extra.get(key, 0) + value
    prompt, cached = extra.get("prompt_tokens", 0), extra.get("cached_tokens", 0)
    extra["replicas"] = [asdict(s) for s in stats]
    return SchedulerStats(**counts, cache_hit_rate=cached / prompt if prompt else 0.0, extra=extra)
