"""KV reservations: a request's hold on slots, rows and cached prefixes, as one opaque handle.

The scheduler never touches the radix tree, the free lists or a node: it asks `KVManager` to
`reserve` a request (match its prefix, lock it, evict, take a row and slots — all of it, or nothing
and no lock held), to `grow` or `shrink` its reservation by slots, to `cache` its computed prefix in
the tree, and to `release` it. The request's slots are mirrored on the host in its `KVHandle`, so no
bookkeeping ever reads the device's `req_to_token` table; the runner writes that table from the
step's `row_writes` (stale entries after a re-pointing) and new tokens' slots.

Invariant (checked by `check`): free slots + slots held by the tree + slots owned by live requests
(`Req.owned_slots`) == total slots. Every method keeps it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.core.kvcache.radix_cache import RadixCache, TokenKey, TreeNode

if TYPE_CHECKING:
    from rxf.core.scheduler.req import Req

logger = logging.getLogger(__name__)


class KVHandle:
    """One request's reservation. Region map: `slots[:cached]` are the tree's (their node is locked
    by this handle), `slots[cached:length]` the request's own, of which `[computed, length)` belong
    to steps still in flight. The device row `row` lists the same slots, except positions from
    `stale_from` on, which the next forward rewrites.

    The mirror is a numpy array (element writes cost ~0.1 us; a decode step appends one slot to
    every running request); `slots()` views it as a tensor.
    """

    __slots__ = ("row", "node", "cached", "computed", "length", "_slots", "stale_from")

    def __init__(self, row: int, node: TreeNode, prefix: torch.Tensor) -> None:
        self.row = row
        self.node = node
        self.cached = self.computed = self.length = int(prefix.numel())
        self._slots = np.empty(max(2 * self.length, 64), dtype=np.int64)
        self._slots[: self.length] = prefix.numpy()
        self.stale_from: int | None = 0 if self.length else None  # the prefix is not in the row yet

    def slots(self, end: int | None = None) -> torch.Tensor:
        """Slots of tokens [0, end) (default: all): a view of the mirror, valid until it changes."""
        return torch.from_numpy(self._slots[: self.length if end is None else end])

    def _append(self, new: torch.Tensor) -> None:
        n = int(new.numel())
        if self.length + n > self._slots.size:
            grown = np.empty(max(2 * self._slots.size, self.length + n), dtype=np.int64)
            grown[: self.length] = self._slots[: self.length]
            self._slots = grown
        if n == 1:
            self._slots[self.length] = int(new)
        else:
            self._slots[self.length : self.length + n] = new.numpy()
        self.length += n

    def _mark_stale(self, start: int) -> None:
        self.stale_from = start if self.stale_from is None else min(self.stale_from, start)


class Reservation:
    """A matched and locked prefix, before its row and slots are taken (`KVManager.reserve`)."""

    def __init__(self, manager: KVManager, req: Req, prefix: torch.Tensor, node: TreeNode) -> None:
        self._manager = manager
        self.req = req
        self.prefix = prefix
        self.node = node
        self.prefix_len = int(prefix.numel())

    def allocate(self, extend_len: int) -> bool:
        """Take a row and `extend_len` slots (evicting unlocked leaves as needed) and attach the
        handle to the request. On failure nothing is taken and the lock is dropped."""
        m = self._manager
        if m.req_to_token_pool.available_size() == 0:
            self.cancel()
            return False
        slots = m.alloc_slots(extend_len)
        if slots is None:
            self.cancel()
            return False
        row = m.req_to_token_pool.alloc()
        assert row is not None
        handle = KVHandle(row, self.node, self.prefix)
        handle._append(slots)
        self.req.kv = handle
        return True

    def cancel(self) -> None:
        self._manager.tree.dec_lock_ref(self.node)


class KVManager:
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, tree: RadixCache,
        pair_keys: bool = False,
    ) -> None:
        """`pair_keys`: the slots also hold K/V that depends on the next token (an EAGLE-3 head's),
        so the tree keys each position by (token, next token) and only positions whose next token is
        known enter it: a cached slot is then shared only by sequences that agree on both."""
        self.req_to_token_pool = req_to_token_pool
        self.pool = token_to_kv_pool
        self.tree = tree
        self.pair_keys = pair_keys

    def _key(self, req: Req, n: int) -> list[TokenKey]:
        """The tree key of the request's first n positions (with pair_keys, n < known_len)."""
        if not self.pair_keys:
            return req.tree_key(n)
        key = req.tree_key(n + 1)
        return list(zip(key[:-1], key[1:], strict=True))

    def _keyable(self, req: Req) -> int:
        """How many of the request's leading positions can be keyed now."""
        return req.known_len - 1 if self.pair_keys else req.known_len

    # ---- capacity ----
    def available(self) -> int:
        """Slots obtainable now: free ones plus those the tree could evict."""
        return self.pool.available_size() + self.tree.evictable_size()

    def free_slots(self) -> int:
        """Slots on the free list (obtainable without evicting anything)."""
        return self.pool.available_size()

    def free_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """n slots, evicting unlocked tree leaves when the free list is short; None if impossible."""
        short = n - self.pool.available_size()
        if short > 0:
            self.tree.evict(short)
        return self.pool.alloc(n)

    # ---- prefix matching and reservation ----
    def _match(self, req: Req, limit: int | None) -> tuple[torch.Tensor, TreeNode]:
        # At least one token stays uncomputed: the forward must produce logits for the last one.
        n = req.known_len - 1
        return self.tree.match_prefix(self._key(req, n if limit is None else min(n, limit)))

    def match_len(self, req: Req) -> int:
        """Tokens of the request cached now (for ordering only: nothing is locked)."""
        return int(self._match(req, None)[0].numel())

    def reserve(self, req: Req, limit: int | None = None) -> Reservation:
        """Match the request's longest cached prefix (at most `limit` tokens) and lock it."""
        assert req.kv is None and req.inflight == 0, "a request is reserved once, with all its tokens known"
        prefix, node = self._match(req, limit)
        self.tree.inc_lock_ref(node)
        return Reservation(self, req, prefix, node)

    # ---- a reservation's life ----
    def grow(self, req: Req, n: int) -> torch.Tensor | None:
        """n more slots for the request's tokens [kv_len, kv_len + n); None (nothing taken) if they
        cannot be had."""
        assert req.kv is not None
        slots = self.alloc_slots(n)
        if slots is not None:
            req.kv._append(slots)
        return slots

    def grow_with(self, req: Req, slots: torch.Tensor) -> None:
        """Append slots taken with `alloc_slots` (a batch's, taken at once) to the reservation."""
        assert req.kv is not None
        req.kv._append(slots)

    def commit(self, req: Req, end: int) -> None:
        """A resolved step computed the request's KV up to position `end`."""
        h = req.kv
        assert h is not None and end <= h.length
        h.computed = max(h.computed, end)

    def truncate(self, req: Req, end: int) -> None:
        """Give back the request's slots of positions [end, length) at once (rejected draft tokens,
        and drafts after a stop): the request owns them, the tree never saw them."""
        h = req.kv
        assert h is not None and h.cached <= end <= h.length
        self.pool.free(h.slots()[end:])
        h.length = end
        h.computed = min(h.computed, end)

    def keep_path(self, req: Req, start: int, nodes: list[int]) -> None:
        """After a tree verify: its newest token sat at position `start` and draft j's slot at
        start + 1 + j; put the slots of the drafts kept (`nodes`, root to leaf) at positions
        start + 1 .., the others after them (for `truncate`). The device row holds the drafts on
        scratch rows only, so its entries from start + 1 on are marked stale."""
        h = req.kv
        assert h is not None and h.cached <= start < h.length
        drafts = h._slots[start + 1 : h.length].copy()
        kept = set(nodes)
        rest = [j for j in range(len(drafts)) if j not in kept]
        h._slots[start + 1 : h.length] = drafts[list(nodes) + rest]
        h._mark_stale(start + 1)

    def row_writes(self, req: Req, end: int) -> tuple[int, torch.Tensor] | None:
        """(start, slots) of the row entries before position `end` that the device row lacks, or
        None; the handle counts them written from now on (the caller hands them to the forward)."""
        writes = self.stale_entries(req, end)
        assert req.kv is not None
        req.kv.stale_from = None
        return writes

    def stale_entries(self, req: Req, end: int) -> tuple[int, torch.Tensor] | None:
        """What `row_writes` gives, left marked stale: for a forward beside the step's (an EAGLE-3
        head's, which reads the same rows) that must not take the writing over from the next step."""
        h = req.kv
        assert h is not None
        start = h.stale_from
        if start is None or start >= end:
            return None
        return start, h.slots(end)[start:].clone()

    def cache(self, req: Req) -> None:
        """Hand the request's computed KV to the tree so that others can share it while it runs.

        Only KV of resolved steps is cached (a step in flight may still fail), and only tokens whose
        values are known can be keyed: afterwards `[0, min(computed, keyable))` is tree-held and
        locked by this request (`_keyable`: known_len, or known_len - 1 with pair_keys).
        """
        h = req.kv
        assert h is not None
        if self.tree.disable:  # nothing to share; insert would take the slots we still use
            return
        end = min(h.computed, self._keyable(req))
        key = self._key(req, end)
        already = self.tree.insert(key, h.slots(end))
        # Our slots for tokens the tree already had are duplicates: give them back.
        if already > h.cached:
            self.pool.free(h.slots()[h.cached : already])
        new_slots, new_node = self.tree.match_prefix(key)
        assert new_slots.numel() == end, "a just-inserted key must match in full"
        if already > h.cached:  # point our row at the tree's copies
            h._slots[h.cached : already] = new_slots[h.cached : already]
            h._mark_stale(h.cached)
        self.tree.inc_lock_ref(new_node)
        self.tree.dec_lock_ref(h.node)
        h.node, h.cached = new_node, end

    def release(self, req: Req, keep_in_tree: bool = True) -> None:
        """End the request's hold on KV: insert its computed, known tokens into the tree (or free
        them), unlock its prefix and free its row. Used on finish, abort and retraction.

        Slots of a step still in flight are freed too: any later step that reuses one runs after it.
        """
        h = req.kv
        if h is None:
            return
        end = max(min(h.computed, self._keyable(req)), h.cached)
        slots = h.slots()
        if keep_in_tree:
            # The tree takes slots[already:end]; ours for tokens it already had are duplicates.
            # (A disabled tree reports every token as already there, so all of ours are freed.)
            already = self.tree.insert(self._key(req, end), slots[:end])
            self.pool.free(slots[h.cached : max(already, h.cached)])
            self.pool.free(slots[end:])
        else:
            self.pool.free(slots[h.cached :])
        self.tree.dec_lock_ref(h.node)
        self.req_to_token_pool.free(h.row)
        req.kv = None
        req.decoding = False

    def clear(self) -> None:
        """Forget everything (flush_cache with nothing in flight)."""
        self.tree.reset()
        self.pool.clear()
        self.req_to_token_pool.clear()

    def check(self, live: list[Req]) -> None:
        """Assert the slot ledger balances. Cheap enough for tests and debug runs."""
        owned = sum(r.owned_slots for r in live if r.kv is not None)
        free, tree = self.pool.available_size(), self.tree.total_size()
        total = self.pool.num_slots
        if free + tree + owned != total:
            raise AssertionError(f"KV ledger: free {free} + tree {tree} + requests {owned} != total {total}")
