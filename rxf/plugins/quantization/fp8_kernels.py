"""Triton kernels of FP8 linear layers on CUDA: dynamic activation quantization and the block-scaled GEMM.

`per_token_group_quant(x, group)`: one program per (row, group of `group` columns) takes the
group's absolute max, writes `x / scale` in FP8 and the float32 scale (`amax / 448`); group = K is
per-token quantization (`torch._scaled_mm`'s `[M, 1]` scales).

`block_scaled_mm(a, a_scale, b, b_scale, block_k, out_dtype)`: `out[m, n] = sum_j (a[m, Kj] .
b[n, Kj]) * a_scale[m, j] * b_scale[n, j]` over the K blocks Kj of `block_k` inputs, each block's
dot product accumulated in float32 then scaled (the scales change per block, so they cannot move
out of the sum). `b_scale` has one row per output row (`fp8_ops`). The kernel is written for any
input dtype: the tests run it under the Triton interpreter with float16 stand-ins holding FP8
values (the interpreter has no FP8 dot).

FlashInfer 0.6 ships `gemm_fp8_nt_groupwise` / `gemm_fp8_nt_blockscaled` for Blackwell only; its
`fp8_blockscale_gemm_sm90` (newer releases) would serve the H200 but wants `[N / 128, K / 128]`
scales and K, N multiples of 128, so rxf keeps its own kernel, which takes any shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # a global read inside kernels must be a constexpr


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, n_groups, GROUP: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch divides: Triton's `/` is approximate and moved some values
    # across a rounding boundary of the FP8 grid on the H200.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * n_groups + g, scale)


def per_token_group_quant(
    x: torch.Tensor, group: int, out_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized `x` `[M, K]` in `out_dtype`, float32 scales `[M, ceil(K / group)]`)."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    n_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    scale = torch.empty(m, n_groups, dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[(m, n_groups)](x, q, scale, k, x.stride(0), q.stride(0), n_groups, GROUP=group,
                                           BLOCK=triton.next_power_of_2(group))
    return q, scale


@triton.jit
def _block_scaled_mm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                            n_kblocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, n_kblocks):
        k = j * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[None, :] * stride_bn + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        sa = tl.load(as_ptr + rm * n_kblocks + j, mask=rm < M, other=0.0)
        sb = tl.load(bs_ptr + rn * n_kblocks + j, mask=rn < N, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))


def block_scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`[M, N]` = block-dequantized `a` `[M, K]` @ `b` `[N, K]`.T (see the module docstring)."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 64 if m <= 16 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_scaled_mm_kernel[grid](
        a, a_scale.contiguous(), b, b_scale.contiguous(), out, m, n, k, a.stride(0), b.stride(0), out.stride(0),
        triton.cdiv(k, block_k), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
