from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from rxf.core.kv_pool import TokenToKVPool
from rxf.core.kvcache.radix_cache import RadixCache, TreeNode


def make_pool(num_slots: int) -> TokenToKVPool:
    # head_dim 2: K[slot] = (token id, hash of the whole prefix up to that token), see write_markers.
    return TokenToKVPool(
        num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu"
    )


def prefix_hashes(key: list[int]) -> list[int]:
    """hashes[p] identifies key[: p + 1]; < 2**24, so exact in float32."""
    out, h = [], 0
    for t in key:
        h = (h * 31 + t + 1) % 1_000_003
        out.append(h)
    return out


def write_markers(pool: TokenToKVPool, key: list[int], start: int, slots: torch.Tensor) -> None:
    """Stand-in for a forward pass: the K of key[start + j] goes to slots[j]."""
    marks = torch.tensor(
        [[key[p], h] for p, h in enumerate(prefix_hashes(key))][start : start + len(slots)],
        dtype=torch.float32,
    ).reshape(-1, 1, 2)
    pool.set_kv(0, slots, marks, marks)


def assert_markers(pool: TokenToKVPool, key: list[int], slots: torch.Tensor) -> None:
    """The slots hold the K of key[: len(slots)], computed with exactly that prefix."""
    expected = [[key[p], h] for p, h in enumerate(prefix_hashes(key))][: len(slots)]
    assert pool.get_kv_buffer(0)[0][slots, 0, :].tolist() == expected


def cache_key(cache: RadixCache, pool: TokenToKVPool, key: list[int]) -> None:
    """Compute `key` from scratch (no prefix reuse) and hand it to the tree, freeing duplicates."""
    slots = pool.alloc(len(key))
    assert slots is not None
    write_markers(pool, key, 0, slots)
    n = cache.insert(key, slots)
    pool.free(slots[:n])


def tree_nodes(cache: RadixCache) -> Iterator[TreeNode]:
    stack = list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def held_by_tree(cache: RadixCache) -> int:
    return sum(len(n.value) for n in tree_nodes(cache))


# ---------------------------------------------------------------- match / insert


def test_match_exact_prefix_divergent_and_empty() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 2, 3, 4, 5])
    for key, hit in [([1, 2, 3, 4, 5], 5), ([1, 2, 3, 4, 5, 6, 7], 5), ([1, 2, 9], 2), ([7, 1], 0), ([], 0)]:
        slots, node = cache.match_prefix(key)
        assert len(slots) == hit and slots.dtype == torch.int64
        assert_markers(pool, key, slots)
        assert (node is cache.root_node) == (hit == 0)
    assert cache.total_size() == 5 == held_by_tree(cache)


def test_match_ending_inside_a_node_splits_it() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 2, 3, 4, 5])
    slots, node = cache.match_prefix([1, 2, 3, 8])
    assert node.key == [1, 2, 3] and node.parent is cache.root_node
    assert [c.key for c in node.children.values()] == [[4, 5]]
    assert_markers(pool, [1, 2, 3], slots)
    full, deep = cache.match_prefix([1, 2, 3, 4, 5])  # the split lost nothing
    assert_markers(pool, [1, 2, 3, 4, 5], full) and deep.key == [4, 5]
    assert cache.total_size() == 5 == held_by_tree(cache)


def test_insert_returns_cached_count_and_duplicates_keep_accounting() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 2, 3, 4])
    # A request recomputes [1, 2, 3] without reusing the cache, then adds [7, 8].
    slots = pool.alloc(5)
    assert slots is not None
    write_markers(pool, [1, 2, 3, 7, 8], 0, slots)
    assert cache.insert([1, 2, 3, 7, 8], slots) == 3
    pool.free(slots[:3])  # the caller's duplicates; slots[3:] now belong to the tree
    assert cache.total_size() == 6 == held_by_tree(cache)
    assert pool.available_size() + cache.total_size() == pool.num_slots
    got, _ = cache.match_prefix([1, 2, 3, 7, 8])
    assert_markers(pool, [1, 2, 3, 7, 8], got)
    assert got[3:].tolist() == slots[3:].tolist()
    # A key that is a strict prefix of cached ones adds nothing.
    dup = pool.alloc(2)
    assert dup is not None and cache.insert([1, 2], dup) == 2
    pool.free(dup)
    assert cache.total_size() == 6


def test_insert_rejects_length_mismatch() -> None:
    cache = RadixCache(make_pool(8))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([1, 2], dtype=torch.int64))


def test_tree_keeps_its_own_copy_of_slots() -> None:
    pool = make_pool(8)
    cache = RadixCache(pool)
    slots = pool.alloc(3)
    assert slots is not None
    expected = slots.tolist()
    cache.insert([1, 2, 3], slots)
    slots.fill_(0)
    assert cache.match_prefix([1, 2, 3])[0].tolist() == expected


# ---------------------------------------------------------------- locks and eviction


def test_lock_protects_from_eviction_and_unlock_restores() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 2, 3, 4])
    cache_key(cache, pool, [1, 2, 9])
    _, node = cache.match_prefix([1, 2, 3, 4])
    assert cache.inc_lock_ref(node) == -4  # [1, 2] and [3, 4]
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert cache.evict(100) == 1  # only the unlocked leaf [9]
    assert cache.match_prefix([1, 2, 3, 4])[0].numel() == 4
    assert cache.dec_lock_ref(node) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    assert cache.evict(100) == 4  # [3, 4], then its parent [1, 2] becomes a leaf in the same call
    assert cache.total_size() == 0 and pool.available_size() == pool.num_slots
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)


def test_multiple_locks_on_one_node() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    cache_key(cache, pool, [5, 6, 7])
    _, node = cache.match_prefix([5, 6, 7])
    assert cache.inc_lock_ref(node) == -3
    assert cache.inc_lock_ref(node) == 0  # already protected
    assert cache.dec_lock_ref(node) == 0  # still held by the other lock
    assert cache.evict(10) == 0 and cache.protected_size() == 3
    assert cache.dec_lock_ref(node) == 3
    assert cache.evict(10) == 3


def test_lock_handle_survives_a_split() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    _, mid = cache.match_prefix([1, 2])  # splits the locked node under its holder
    assert mid.lock_ref == 1 and node.parent is mid
    cache_key(cache, pool, [1, 2, 8])
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert cache.dec_lock_ref(node) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)


def test_evict_takes_least_recently_used_leaf_first() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 1, 1])
    cache_key(cache, pool, [2, 2, 2])
    cache_key(cache, pool, [3, 3, 3])
    cache.match_prefix([1, 1, 1])  # touch the oldest: [2, 2, 2] is now least recently used
    assert cache.evict(2) == 3  # a whole leaf goes: at least the asked number of slots
    assert cache.match_prefix([2, 2, 2])[0].numel() == 0
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3
    assert cache.evict(1) == 3 and cache.match_prefix([3, 3, 3])[0].numel() == 0
    assert cache.evict(0) == 0


def test_untouched_tail_of_a_split_node_keeps_its_age() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 1, 1])
    cache_key(cache, pool, [2, 2, 2])
    cache.match_prefix([1, 1])  # splits off [1]: only [1, 1] was used now
    assert cache.evict(1) == 1  # the tail [1] is the oldest leaf
    assert cache.match_prefix([1, 1, 1])[0].numel() == 2
    assert cache.match_prefix([2, 2, 2])[0].numel() == 3


# ---------------------------------------------------------------- disabled mode and reset


def test_disabled_cache_holds_nothing_and_caller_frees_everything() -> None:
    pool = make_pool(8)
    cache = RadixCache(pool, disable=True)
    slots = pool.alloc(4)
    assert slots is not None
    n = cache.insert([1, 2, 3, 4], slots)
    assert n == 4  # nothing taken: the caller frees slots[:4] as with any duplicate
    pool.free(slots[:n])
    got, node = cache.match_prefix([1, 2, 3, 4])
    assert got.numel() == 0 and node is cache.root_node
    assert cache.inc_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 0
    assert cache.evict(4) == 0 and cache.total_size() == 0
    assert pool.available_size() == pool.num_slots
    cache.reset()


def test_reset_frees_everything_and_refuses_while_locked() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    cache_key(cache, pool, [1, 2, 3])
    cache_key(cache, pool, [1, 4])
    _, node = cache.match_prefix([1, 4])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and not cache.root_node.children
    assert pool.available_size() == pool.num_slots
    assert "total=0" in cache.pretty_print()


def test_pretty_print_shows_structure() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    cache_key(cache, pool, list(range(1, 13)))
    cache_key(cache, pool, [1, 2, 40])
    text = cache.pretty_print()
    assert "[1 2] len=2 lock=0" in text and "  [40] len=1" in text and "..." in text


# ---------------------------------------------------------------- randomized simulation


@dataclass
class Req:
    key: list[int]
    prefix: torch.Tensor  # the tree's slots for key[:len(prefix)], locked through `node`
    node: TreeNode
    new: torch.Tensor  # slots this request owns, for key[len(prefix):]


def check_invariants(cache: RadixCache, pool: TokenToKVPool, live: list[Req]) -> None:
    tree = cache.all_slots()
    everything = torch.cat([pool._free, tree, *(r.new for r in live)])
    # Free list, tree and running requests partition slots 1..N: no slot lost, none in two places.
    assert sorted(everything.tolist()) == list(range(1, pool.num_slots + 1))
    assert cache.total_size() == len(tree) == cache.evictable_size() + cache.protected_size()
    pins: Counter[int] = Counter()
    for r in live:
        node: TreeNode | None = r.node
        while node is not None and node is not cache.root_node:
            pins[id(node)] += 1
            node = node.parent
    nodes = list(tree_nodes(cache))
    assert all(n.lock_ref == pins[id(n)] for n in nodes)
    assert cache.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref)


def random_key(rng: random.Random, bases: list[list[int]]) -> list[int]:
    base = rng.choice(bases)
    return base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 6))]


def start_request(cache: RadixCache, pool: TokenToKVPool, key: list[int]) -> Req | None:
    prefix, node = cache.match_prefix(key)
    assert_markers(pool, key, prefix)
    cache.inc_lock_ref(node)
    need = len(key) - len(prefix)
    new = pool.alloc(need)
    if new is None:
        cache.evict(need - pool.available_size())
        new = pool.alloc(need)
    if new is None:  # does not fit even after eviction: give the prefix back
        cache.dec_lock_ref(node)
        return None
    write_markers(pool, key, len(prefix), new)
    return Req(key, prefix, node, new)


def finish_request(cache: RadixCache, pool: TokenToKVPool, req: Req) -> None:
    assert_markers(pool, req.key, req.prefix)  # the locked prefix was never evicted and reused
    slots = torch.cat((req.prefix, req.new))
    n = cache.insert(req.key, slots)
    assert n >= len(req.prefix)
    pool.free(slots[len(req.prefix) : n])
    cache.dec_lock_ref(req.node)


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_requests_keep_the_slot_partition(seed: int, disable: bool) -> None:
    rng = random.Random(seed)
    pool = make_pool(40)
    cache = RadixCache(pool, disable=disable)
    bases = [[rng.randint(0, 3) for _ in range(rng.randint(4, 10))] for _ in range(4)]
    live: list[Req] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.45:
            req = start_request(cache, pool, random_key(rng, bases))
            if req is not None:
                live.append(req)
        elif op < 0.85 and live:
            finish_request(cache, pool, live.pop(rng.randrange(len(live))))
        elif op < 0.93:
            key = random_key(rng, bases)
            assert_markers(pool, key, cache.match_prefix(key)[0])
        else:
            want, evictable = rng.randint(1, 12), cache.evictable_size()
            freed = cache.evict(want)
            assert freed >= want if evictable >= want else freed == evictable
        check_invariants(cache, pool, live)
    while live:
        finish_request(cache, pool, live.pop())
    check_invariants(cache, pool, live)
    assert cache.protected_size() == 0
    cache.reset()
    assert cache.total_size() == 0 and pool.available_size() == pool.num_slots
