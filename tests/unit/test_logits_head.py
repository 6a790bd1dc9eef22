"""The logits head writing into rows the CUDA-graph runner hands it (`LogitsHead.graph_output`, so that
every captured batch size's logits share one buffer): the same float32 logits as without them, in
those rows; rows of another shape are ignored. The runner's side is tests/gpu/test_cuda_graph_gpu.py."""

from __future__ import annotations

import pytest
import torch

from rxf.plugins.models.layers.embedding import LogitsHead


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_head_writes_the_rows_it_is_given(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    head = LogitsHead(50, 16, tp_size=1, tp_rank=0, dtype=dtype)
    head.weight.data.copy_(torch.randn(50, 16, generator=gen))
    hidden = torch.randn(3, 16, generator=gen).to(dtype)
    plain = head(hidden)
    assert plain.dtype == torch.float32 and plain.shape == (3, 50)

    shared = torch.full((8, 50), float("nan"))
    head.graph_output = shared[:3]
    try:
        out = head(hidden)
    finally:
        head.graph_output = None
    assert out.data_ptr() == shared.data_ptr(), "the logits are the rows handed over"
    assert torch.equal(out, plain) and torch.equal(shared[:3], plain)
    assert shared[3:].isnan().all(), "rows past the batch are not touched"


def test_head_ignores_rows_of_another_shape() -> None:
    head = LogitsHead(50, 16, tp_size=1, tp_rank=0, dtype=torch.float32)
    head.weight.data.normal_()
    hidden = torch.randn(3, 16)
    shared = torch.zeros(4, 50)
    head.graph_output = shared  # 4 rows for a batch of 3
    try:
        out = head(hidden)
    finally:
        head.graph_output = None
    assert out.data_ptr() != shared.data_ptr() and not shared.any()
    torch.testing.assert_close(out, hidden @ head.weight.data.T)
