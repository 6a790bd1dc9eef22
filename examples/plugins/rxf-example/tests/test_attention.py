"""batched_sdpa against rxf's reference backend, torch_native, on random paged batches."""

from __future__ import annotations

import pytest
import torch
from rxf_example.attention import BatchedSDPABackend

from rxf.testing.attention import compare_backends

CASES = {
    "prefill": ([0, 0, 0], [7, 1, 12]),
    "extend over cached prefixes": ([5, 0, 17], [3, 9, 1]),
    "decode": ([4, 30, 11, 1], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_matches_torch_native(case, heads, kv_heads):
    prefix_lens, extend_lens = CASES[case]
    out, ref, k_pool, ref_k_pool = compare_backends(
        BatchedSDPABackend, prefix_lens, extend_lens, heads=heads, kv_heads=kv_heads, head_dim=16,
        dtype=torch.float32, device="cpu",
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_pool, ref_k_pool)  # the new tokens' K landed in the same slots
