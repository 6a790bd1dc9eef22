"""A radix tree over token ids whose nodes hold the KV slots of those tokens (page size 1).

Ownership (DESIGN §3): every slot referenced by a node belongs to the tree and goes back to the
pool only through `evict` or `reset`. The pool's free list, the tree and the running requests
partition the pool's slots:

    pool.available_size() + cache.total_size() + slots held by running requests == pool.num_slots

Locking: a request that reads a cached prefix locks the node `match_prefix` returned. A lock pins
that node and all its ancestors, so the slots the request reads cannot be evicted under it.

Keys are token ids, except that a request with a `cache_salt` has its first token replaced by
(salt, token) and an image's or video's positions are (its hash, i) (`Req.tree_key`): a tuple never
equals an int or another salt's or item's tuple, so each salt gets a subtree of its own below the
root, an item's KV is shared only with the same item, and the tree only compares keys for equality.
With an EAGLE-3 head each key is the pair (key, next token) (`KVManager(pair_keys=True)`).

Handles stay valid across splits: a split puts a new node *above* the existing one, so a node
object always covers the same full prefix from the root, and unlocking an old handle releases
exactly the path that locking it pinned.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from rxf.core.kv_pool import TokenToKVPool

# A token id, a salted first token, an item's position, or any of them paired with the next token (see
# the module docstring).
TokenKey = int | tuple[Any, int]


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the tree: token ids `key` and their KV slots `value` (CPU int64).

    Opaque to the scheduler, which only hands it back to `inc_lock_ref` / `dec_lock_ref`.
    Invariants: len(key) == len(value), both empty only at the root; `children` is keyed by the
    first token of each child's key; a node's lock_ref >= each of its children's lock_ref.
    """

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[TokenKey], value: torch.Tensor, parent: TreeNode | None, now: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[TokenKey, TreeNode] = {}
        self.lock_ref = 0  # how many lock holders pin this node (directly or through a descendant)
        self.last_access = now  # logical clock tick; smaller = less recently used

    def __lt__(self, other: TreeNode) -> bool:  # orders the eviction heap: LRU first
        return self.last_access < other.last_access


def _path_to_root(node: TreeNode) -> Iterator[TreeNode]:
    """`node` and its ancestors, excluding the root (the only node without a parent)."""
    while node.parent is not None:
        yield node
        node = node.parent


def _common_len(edge: list[TokenKey], key: list[TokenKey], start: int) -> int:
    """Length of the common prefix of `edge` and `key[start:]`."""
    n = min(len(edge), len(key) - start)
    for j in range(n):
        if edge[j] != key[start + j]:
            return j
    return n


class RadixCache:
    """Prefix cache of KV slots keyed by token ids, with LRU eviction of unlocked leaves.

    Ownership contract of `insert(key, slots)` (identical with and without `disable`): it returns
    n, and the tree takes ownership of `slots[n:]` and of nothing else. `slots[:n]` stay the
    caller's: those it obtained from `match_prefix` are the tree's own slots (leave them alone),
    the rest are duplicates of tokens already cached, which the caller must free. A caller that
    matched a prefix of length p (and kept it locked until the insert) therefore frees
    `slots[p:n]`. With `disable=True` the tree holds nothing: `match_prefix` returns no slots
    (p == 0) and `insert` returns len(key), so the caller frees all of its slots itself.
    """

    def __init__(self, token_to_kv_pool: TokenToKVPool, disable: bool = False) -> None:
        self.token_to_kv_pool = token_to_kv_pool
        self.disable = disable
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = TreeNode([], _no_slots(), None, 0)
        self.root_node.lock_ref = 1  # the root is always locked: never evicted, holds no slots
        self._evictable = 0  # slots in nodes with lock_ref == 0
        self._protected = 0  # slots in non-root nodes with lock_ref > 0

    # ---- lookup and insertion ----
    def match_prefix(self, key: list[TokenKey]) -> tuple[torch.Tensor, TreeNode]:
        """Slots of the longest cached prefix of `key` and the node covering exactly that prefix.

        Splits a node when the match ends inside it; marks the matched path as used now.
        The slots may be evicted unless the caller locks the returned node before using them.
        """
        if self.disable:
            return _no_slots(), self.root_node
        now = next(self._clock)
        node, i, parts = self.root_node, 0, []
        while i < len(key) and (child := node.children.get(key[i])) is not None:
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)  # the loop then stops: nothing below matches key[i+n]
            child.last_access = now
            parts.append(child.value)
            node, i = child, i + n
        return (torch.cat(parts) if parts else _no_slots()), node

    def insert(self, key: list[TokenKey], slots: torch.Tensor) -> int:
        """Cache key -> slots; returns how many leading tokens of `key` were already cached.

        See the class docstring for which slots the caller must free afterwards.
        """
        if len(key) != len(slots):
            raise ValueError(f"key has {len(key)} tokens but {len(slots)} slots were given")
        if self.disable:
            return len(key)
        now = next(self._clock)
        node, i = self.root_node, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                self._add_leaf(node, key[i:], slots[i:], now)
                break
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)  # any divergent rest becomes a leaf of the new node
            child.last_access = now
            node, i = child, i + n
        return i

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Put a new node holding node.key[:n] above `node` (0 < n < len(node.key)); return it."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key)
        mid = TreeNode(node.key[:n], node.value[:n], parent, node.last_access)
        mid.lock_ref = node.lock_ref  # every holder of a lock on `node` also pins its new ancestor
        mid.children[node.key[n]] = node
        parent.children[node.key[0]] = mid
        node.key, node.value, node.parent = node.key[n:], node.value[n:], mid
        return mid

    def _add_leaf(self, parent: TreeNode, key: list[TokenKey], slots: torch.Tensor, now: int) -> None:
        # The tree keeps its own copy so later changes to the caller's tensor cannot reach it.
        leaf = TreeNode(list(key), slots.to(device="cpu", dtype=torch.int64).clone(), parent, now)
        parent.children[key[0]] = leaf
        self._evictable += len(key)  # a new leaf is unlocked even when its parent is locked

    # ---- locking ----
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pin `node` and its ancestors; returns the change in evictable_size (<= 0)."""
        delta = 0
        for n in _path_to_root(node):
            if n.lock_ref == 0:
                delta -= len(n.key)
            n.lock_ref += 1
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one lock taken by `inc_lock_ref(node)`; returns the change in evictable_size (>= 0)."""
        delta = 0
        for n in _path_to_root(node):
            if n.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on a node that is not locked")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                delta += len(n.key)
        self._evictable += delta
        self._protected -= delta
        return delta

    # ---- eviction ----
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots, if there are that many evictable, LRU leaves first.

        A parent left without children (and unlocked) becomes a candidate in the same call.
        Returns the number of slots given back to the pool.
        """
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]  # root: locked
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.token_to_kv_pool.free(leaf.value)
            freed += len(leaf.key)
            del parent.children[leaf.key[0]]
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        self._evictable -= freed
        return freed

    def reset(self) -> None:
        """Drop every node and free all its slots; refused while any node is locked."""
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} slots still locked by requests")
        self.token_to_kv_pool.free(self.all_slots())
        self._init_tree()

    # ---- sizes and debugging ----
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for invariant checks: disjoint from the pool's free list)."""
        return torch.cat([n.value for n in self._nodes()])

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pretty_print(self) -> str:
        lines: list[str] = []
        stack = [(child, 0) for child in self.root_node.children.values()]
        while stack:  # iterative: a chain of splits can be deeper than Python's recursion limit
            node, depth = stack.pop()
            head = " ".join(map(str, node.key[:8])) + (" ..." if len(node.key) > 8 else "")
            lines.append(f"{'  ' * depth}[{head}] len={len(node.key)} lock={node.lock_ref}")
            stack.extend((child, depth + 1) for child in node.children.values())
        lines.append(f"total={self.total_size()} evictable={self._evictable} protected={self._protected}")
        return "\n".join(lines)
