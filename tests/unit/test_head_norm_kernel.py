"""The per-head q/k RMSNorm Triton kernel against the `RMSNorm` torch path, on CPU under the Triton
interpreter (fp32, fp16), on strided rows as the model hands them over (the fused qkv output, here
with padding columns past v so the row stride differs from the used width).

As in test_fused_moe.py, TRITON_INTERPRET is set before the kernel module is imported, and the module
is skipped where CUDA is present (tests/gpu/test_qwen3_gpu.py covers the compiled kernel).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_qwen3_gpu.py covers the compiled kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.models.layers import RMSNorm  # noqa: E402
from rxf.plugins.models.layers.head_norm import norm_heads_  # noqa: E402
from rxf.plugins.models.layers.head_norm_kernel import norm_heads_cuda_  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), [(5, 4, 2, 32), (3, 6, 1, 24), (1, 8, 8, 16)])
def test_kernel_matches_torch_path(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype) -> None:
    gen = torch.Generator().manual_seed(tokens * heads)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6, dtype), RMSNorm(head_dim, 1e-6, dtype)
    q_norm.weight.data = (torch.randn(head_dim, generator=gen) * 0.3 + 1).to(dtype)
    k_norm.weight.data = (torch.randn(head_dim, generator=gen) * 0.3 + 1).to(dtype)
    width = (heads + 2 * kv_heads) * head_dim
    rows = (torch.randn(tokens, width + 8, generator=gen) * 4).to(dtype)
    qkv = rows[:, :width]  # row stride width + 8
    expected = qkv.clone()
    norm_heads_(expected, q_norm, k_norm, heads, kv_heads, head_dim)  # CPU tensors: the torch path
    untouched = rows[:, width:].clone()
    norm_heads_cuda_(qkv, q_norm.weight, k_norm.weight, heads, kv_heads, head_dim, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(qkv.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.equal(rows[:, width:], untouched)


def test_empty_batch_is_a_no_op() -> None:
    w = torch.ones(16)
    norm_heads_cuda_(torch.empty(0, 64), w, w, 2, 1, 16, 1e-6)
