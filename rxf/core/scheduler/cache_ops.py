"""KV bookkeeping between requests, the slot pools and the radix tree.

Invariant (checked by `MemoryLedger.check`): free slots + slots held by the tree + slots owned by
live requests (`Req.owned_slots`) == total slots. Every function here keeps it.
"""

from __future__ import annotations

import logging

import torch

from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.core.radix_cache import RadixCache
from rxf.core.scheduler.req import Req

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, tree: RadixCache) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.pool = token_to_kv_pool
        self.tree = tree

    # ---- capacity ----
    def available(self) -> int:
        """Slots obtainable now: free ones plus those the tree could evict."""
        return self.pool.available_size() + self.tree.evictable_size()

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """n slots, evicting unlocked tree leaves when the free list is short; None if impossible."""
        short = n - self.pool.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.pool.alloc(n)

    # ---- prefix matching ----
    def match(self, req: Req, limit: int | None = None) -> tuple[torch.Tensor, object]:
        """Longest cached prefix of the request's tokens that still leaves one token to compute
        (the forward must produce logits for the last token)."""
        n = req.seq_len - 1
        return self.tree.match_prefix(req.tree_key(n if limit is None else min(n, limit)))

    def lock(self, req: Req, slots: torch.Tensor, node: object) -> None:
        self.tree.inc_lock_ref(node)
        req.prefix_indices, req.last_node, req.kv_len = slots, node, int(slots.numel())

    def unlock(self, req: Req) -> None:
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = None

    # ---- request lifetime ----
    def row_slots(self, req: Req) -> torch.Tensor:
        assert req.req_pool_idx is not None
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to("cpu", torch.int64)

    def cache_unfinished(self, req: Req) -> None:
        """Hand the request's computed KV to the tree so that others can share it while it runs.

        Afterwards the whole `[0, kv_len)` is tree-held and locked by this request.
        """
        if self.tree.disable:  # nothing to share; insert would take the slots we still use
            return
        slots = self.row_slots(req)
        key = req.tree_key(req.kv_len)
        already = self.tree.insert(key, slots)
        # Our slots for tokens the tree already had are duplicates: give them back.
        self.pool.free(slots[req.cached_len : already])
        new_slots, new_node = self.tree.match_prefix(key)
        assert new_slots.numel() == req.kv_len, "a just-inserted key must match in full"
        if already > req.cached_len:  # point our row at the tree's copies
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            row[req.cached_len : already] = new_slots[req.cached_len : already].to(row.device, row.dtype)
        self.unlock(req)
        self.lock(req, new_slots, new_node)

    def release(self, req: Req, keep_in_tree: bool = True) -> None:
        """End the request's hold on KV: insert its computed tokens into the tree (or free them),
        unlock its prefix and free its row. Used on finish, abort and retraction."""
        if req.req_pool_idx is None:
            return
        slots = self.row_slots(req)
        if keep_in_tree:
            # The tree takes slots[already:]; ours for tokens it already had are duplicates.
            # (A disabled tree reports every token as already there, so all of ours are freed.)
            already = self.tree.insert(req.tree_key(req.kv_len), slots)
            self.pool.free(slots[req.cached_len : already])
        else:
            self.pool.free(slots[req.cached_len :])
        self.unlock(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.kv_len = 0
        req.decoding = False

    def check(self, live: list[Req]) -> None:
        """Assert the slot ledger balances. Cheap enough for tests and debug runs."""
        owned = sum(r.owned_slots for r in live if r.req_pool_idx is not None)
        free, tree = self.pool.available_size(), self.tree.total_size()
        total = self.pool.num_slots
        if free + tree + owned != total:
            raise AssertionError(f"KV ledger: free {free} + tree {tree} + requests {owned} != total {total}")
