"""The Triton kernel of `head_norm.norm_heads_`: one program per token normalises that token's q and
k heads in place (a `[BLOCK_H, BLOCK_D]` tile: every head of the token, padded to powers of two).

Rounding as `RMSNorm`: the sum of squares and the scaling in float32, the normalised value cast to
the tensor's dtype, then multiplied by the weight in float32 and cast once more (what torch's
`weight * x.to(dtype)` computes for half-precision operands). Under programmatic dependent launch
(`rxf/core/runner/pdl.py`) the norm weights are read before waiting for the qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl


@triton.jit
def _norm_heads_kernel(
    QKV, QW, KW, stride_t, eps,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_w = tl.load(QW + dims, mask=dim_ok, other=0.0).to(tl.float32)  # fixed at load: read before waiting
    k_w = tl.load(KW + dims, mask=dim_ok, other=0.0).to(tl.float32)
    weight = tl.where((heads < Q_HEADS)[:, None], q_w[None, :], k_w[None, :])
    if PDL:  # the qkv projection writes qkv (rxf/core/runner/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    mask = (heads < Q_HEADS + K_HEADS)[:, None] & dim_ok[None, :]
    ptrs = QKV + token * stride_t + heads[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    normed = (x * inv_rms[:, None]).to(QKV.dtype.element_ty).to(tl.float32)
    tl.store(ptrs, (normed * weight).to(QKV.dtype.element_ty), mask=mask)


def norm_heads_cuda_(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
) -> None:
    """In place over `qkv` `[tokens, >= (num_heads + num_kv_heads) * head_dim]` (last dim contiguous)."""
    if qkv.shape[0] == 0:
        return
    pdl = use_pdl(qkv)
    _norm_heads_kernel[(qkv.shape[0],)](
        qkv, q_weight, k_weight, qkv.stride(0), eps,
        Q_HEADS=num_heads, K_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PDL=pdl, launch_pdl=pdl,
    )
