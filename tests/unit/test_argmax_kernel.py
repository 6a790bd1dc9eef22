"""`argmax_kernel.split_argmax` (greedy sampling's row argmax for small CUDA batches) against
torch.argmax, on CPU under the Triton interpreter: ties across and within chunks, NaN, -inf rows
and vocabularies that are not a multiple of the chunk."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the sampling GPU tests cover the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.core.runner.argmax_kernel import split_argmax  # noqa: E402

CHUNK = 64  # several chunks at test vocabularies


@pytest.mark.parametrize("vocab", [50, 64, 1000])
def test_matches_torch_argmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen)
    x[1, 3] = x[1, vocab - 1] = x[1].max() + 1  # a tie: the first index wins
    x[2] = -float("inf")  # nothing but -inf: index 0
    x[3, vocab // 2] = float("nan")  # NaN counts as the largest
    x[4, :] = 0.5  # all equal
    x[5, vocab - 1] = 1e30  # the last column, in a partial chunk
    assert torch.equal(split_argmax(x, CHUNK), x.argmax(dim=-1))


def test_half_precision_and_row_strides() -> None:
    x = torch.randn(3, 2 * 300, generator=torch.Generator().manual_seed(1)).half()[:, :300]  # rows strided
    assert torch.equal(split_argmax(x, CHUNK), x.argmax(dim=-1))
