"""Triton kernels of FP8 linear layers on CUDA: dynamic activation quantization and the block-scaled GEMM.

`per_token_group_quant(x, group)`: one program per row and run of groups (a tile of ~4096 inputs)
takes each group's absolute max, writes `x / scale` in FP8 and the float32 scale (`amax / 448`);
group = K is per-token quantization (`torch._scaled_mm`'s `[M, 1]` scales). It can pad the rows and
store the scales column-major, as cuBLAS's block-scaled GEMM reads them (`fp8_ops.block_fp8_linear`).

`block_scaled_mm(a, a_scale, b, b_scale, block_k, out_dtype)`: `out[m, n] = sum_j (a[m, Kj] .
b[n, Kj]) * a_scale[m, j] * b_scale[n, j]` over the K blocks Kj of `block_k` inputs, each block's
dot product accumulated in float32 then scaled (the scales change per block, so they cannot move
out of the sum). `b_scale` has one row per output row (`fp8_ops`). The kernel is written for any
input dtype: the tests run it under the Triton interpreter with float16 stand-ins holding FP8
values (the interpreter has no FP8 dot). On Hopper, cuBLAS's block scaling (`torch._scaled_mm`)
serves 128-wide blocks instead; this kernel takes any other block shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # a global read inside kernels must be a constexpr


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s_row, stride_s_group, n_groups,
                        GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, GROUPS: tl.constexpr, GATED: tl.constexpr):
    # One program: GROUPS consecutive groups of one row, a [GROUPS, GROUP_BLOCK] tile. Rows at or past
    # M (padding) read zeros: their codes are 0 and their scales the floor's, finite.
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP_BLOCK)
    cols = g[:, None] * GROUP + c[None, :]
    in_row = (c[None, :] < GROUP) & (cols < K)
    real = (cols * 0 + row) < M  # a tensor: the interpreter takes no scalar in a mask
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row & real, other=0.0).to(tl.float32)
    if GATED:  # the row is [gate | up] (2K wide): quantize silu(gate) * up, rounded to the input dtype
        # first, as SiluAndMul's output would be, so the codes equal the unfused path's
        up = tl.load(x_ptr + row * stride_x + K + cols, mask=in_row & real, other=0.0).to(tl.float32)
        x = (x / (1.0 + tl.exp(-x)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    # IEEE divisions (div_rn), as torch divides: Triton's `/` is approximate and moved some values
    # across a rounding boundary of the FP8 grid on the H200.
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12), FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=in_row)
    tl.store(s_ptr + row * stride_s_row + g * stride_s_group, scale, mask=g < n_groups)


_QUANT_TILE = 4096  # elements a program quantizes (at least one group): [groups, group] per row


def per_token_group_quant(
    x: torch.Tensor, group: int, out_dtype: torch.dtype = torch.float8_e4m3fn, *, pad_rows: int = 1,
    column_major: bool = False, gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized `x` `[M', K]` in `out_dtype`, float32 scales `[M', ceil(K / group)]`) with M' = M
    rounded up to `pad_rows` (padding rows: zeros, tiny scales). `column_major`: the scales' storage
    is `[groups, M']` (stride 1 along rows), the layout cuBLAS's 1 x 128 block scaling reads.
    `gated`: `x` is `[M, 2K]` = `[gate | up]` and what is quantized is `SiluAndMul`'s output."""
    m, k = x.shape
    k //= 2 if gated else 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows = -(-m // pad_rows) * pad_rows
    n_groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=out_dtype, device=x.device)
    if column_major:
        scale = torch.empty(n_groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(rows, n_groups, dtype=torch.float32, device=x.device)
    if rows:
        group_block = triton.next_power_of_2(group)
        groups = min(max(1, _QUANT_TILE // group_block), triton.next_power_of_2(n_groups))
        _group_quant_kernel[(rows, triton.cdiv(n_groups, groups))](
            x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), n_groups,
            GROUP=group, GROUP_BLOCK=group_block, GROUPS=groups, GATED=gated, num_warps=8 if groups * group_block > 4096 else 4,
        )
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
