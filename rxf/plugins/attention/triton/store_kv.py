"""Writing new tokens' K and V into the page-size-1 pool in one Triton launch.

`TokenToKVPool.set_kv` does it with two index_put kernels; at batch 1 with CUDA graphs each costs
about 3 us of GPU time for a few KB, i.e. two launches per layer dominated by fixed cost. One program
per new token copies that token's K and V rows (all KV heads) to its slot, casting to the pool dtype.
Region map: program i reads k[i], v[i], loc[i]; writes k_buf[loc[i]], v_buf[loc[i]] (slots are distinct
within a batch, so programs never write the same row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Loc,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(Loc + i).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(KBuf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :],
             k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
             v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buf[loc[i]] = k[i] and v_buf[loc[i]] = v[i] for every i (k, v: [n, kv_heads, head_dim])."""
    n, heads, head_dim = k.shape
    if n == 0:
        return
    for t in (k, v, k_buf, v_buf):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    _store_kv_kernel[(n,)](
        k, v, k_buf, v_buf, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4 if heads * head_dim >= 1024 else 1,
    )
