from __future__ import annotations

import pytest
import torch

from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool


def make_pool(num_slots: int = 8, num_layers: int = 2) -> TokenToKVPool:
    return TokenToKVPool(num_slots, num_layers, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")


def test_req_to_token_rows_alloc_free_and_exhaustion() -> None:
    pool = ReqToTokenPool(size=3, max_context_len=16, device="cpu")
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int32
    rows = [pool.alloc() for _ in range(3)]
    assert rows == [0, 1, 2]
    assert pool.alloc() is None and pool.available_size() == 0
    pool.free(1)
    assert pool.available_size() == 1 and pool.alloc() == 1
    pool.clear()
    assert pool.available_size() == 3


def test_token_pool_alloc_hands_out_distinct_slots_never_zero() -> None:
    pool = make_pool(8)
    a, b = pool.alloc(5), pool.alloc(3)
    assert a is not None and b is not None
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    got = torch.cat((a, b)).tolist()
    assert sorted(got) == list(range(1, 9))  # slot 0 is reserved for padding
    assert pool.available_size() == 0


def test_token_pool_exhaustion_returns_none_and_takes_nothing() -> None:
    pool = make_pool(8)
    assert pool.alloc(6) is not None
    assert pool.alloc(3) is None
    assert pool.available_size() == 2
    assert pool.alloc(2) is not None


def test_token_pool_free_then_realloc() -> None:
    pool = make_pool(4)
    slots = pool.alloc(4)
    assert slots is not None
    pool.free(slots[1:3])
    assert pool.available_size() == 2
    again = pool.alloc(2)
    assert again is not None and sorted(again.tolist()) == sorted(slots[1:3].tolist())
    pool.free(torch.empty(0, dtype=torch.int64))  # freeing nothing is a no-op
    assert pool.available_size() == 0
    pool.clear()
    assert pool.available_size() == 4


def test_set_kv_get_kv_buffer_round_trip() -> None:
    pool = make_pool(8, num_layers=2)
    slots = pool.alloc(3)
    assert slots is not None
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    pool.set_kv(1, slots, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert k_buf.shape == (9, 2, 4)  # num_slots + 1: slot 0 included
    torch.testing.assert_close(k_buf[slots], k)
    torch.testing.assert_close(v_buf[slots], v)
    assert pool.get_kv_buffer(0)[0].abs().sum() == 0  # other layers untouched
    assert pool.bytes_per_slot() == 2 * 2 * 2 * 4 * 4


def test_page_size_other_than_one_is_refused() -> None:
    with pytest.raises(NotImplementedError):
        TokenToKVPool(8, 1, 1, 4, torch.float32, "cpu", page_size=16)
