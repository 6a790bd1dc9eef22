"""The dequantizing int4 GEMM (AWQ, GPTQ on CUDA), in Triton.

`int4_linear(x, qweight, scales, zeros, group_size, bias)`: `x @ W.T + bias` with `W[n, k] =
(q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]`, `qweight` int32 `[K / 8, N]`
holding inputs 8r..8r+7 of output n in nibbles 0..7 of word `[r, n]` (`int4.py`'s layout). Each
program unpacks a `[BLOCK_K, BLOCK_N]` tile of codes to `x`'s dtype and runs one `tl.dot`; BLOCK_K
divides the group size, so a tile needs one row of scales and zeros. Decode batches (few rows) split
K over programs (`SPLIT_K`) so that enough programs read the weight, adding into a float32 output.

From `DEQUANT_ROWS` rows of x on (prefill), the weight is dequantized whole into a `[K, N]` buffer
of x's dtype (`int4_dequantize`: one pass, memory-bound) and cuBLAS multiplies: the GEMM above
dequantizes each tile once per 64 rows of x, with an int-to-float conversion per code, where cuBLAS
then runs at its bf16 rate on the one dequantized copy (which lives for the call).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Rows of x from which `int4_linear` dequantizes the weight whole for cuBLAS (the module docstring): past
# the decode GEMV's 16. On an H100 (2026-12-05, benchmarks/RESULTS.md, `gpu_int4_gemm.py`) Llama-3-8B's
# four projections summed took 203 us in the Triton GEMM and 358 us dequantized at 16 rows, 463 against
# 361 at 32 (17-31 rows run the GEMM's 32-row grid: one 64-row block, no split), 89.4 ms against 10.6 at
# 16k rows (bf16: 10.1).
_DEQUANT_ENV = os.environ.get("RXF_INT4_DEQUANT_ROWS", "17")
if not _DEQUANT_ENV.isdigit():
    raise ValueError(f"RXF_INT4_DEQUANT_ROWS={_DEQUANT_ENV!r}: expected a row count (a non-negative integer)")
DEQUANT_ROWS = int(_DEQUANT_ENV)


@triton.jit
def _int4_mm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, group_size,
                    k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        words = tl.load(q_ptr + (k[:, None] // 8) * N + rn[None, :], mask=(k[:, None] < K) & (rn[None, :] < N), other=0)
        codes = (words >> ((k[:, None] % 8) * 4)) & 0xF
        g = k0 // group_size
        s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0)
        z = tl.load(z_ptr + g * N + rn, mask=rn < N, other=0.0)
        w = ((codes.to(tl.float32) - z[None, :].to(tl.float32)) * s[None, :].to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, out_dtype=tl.float32)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=mask)


@triton.jit
def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, K, N, group_size, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    # One program: BLOCK_R word rows (8 * BLOCK_R inputs) x BLOCK_N outputs; nibble j of word row r
    # is input 8r + j, stored as row 8r + j of out [K, N]; BLOCK_R * 8 divides the group size.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (r[:, None] * 8 < K) & (n[None, :] < N)
    words = tl.load(q_ptr + r[:, None] * N + n[None, :], mask=ok, other=0)
    g = (tl.program_id(0) * BLOCK_R * 8) // group_size
    s = tl.load(s_ptr + g * N + n, mask=n < N, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + n, mask=n < N, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        codes = ((words >> (4 * j)) & 0xF).to(tl.float32)
        w = ((codes - z[None, :]) * s[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (r[:, None] * 8 + j).to(tl.int64) * N + n[None, :], w, mask=ok)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """`W.T` `[K, N]` in `dtype`: `(q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]`
    rounded once, from `qweight` int32 `[K / 8, N]` (the module docstring's layout)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_r = min(16, (group_size // 8) & -(group_size // 8))  # word rows of a tile: inside one group
    grid = (triton.cdiv(k // 8, block_r), triton.cdiv(n, 128))
    _int4_dequant_kernel[grid](qweight, scales, zeros, out, k, n, group_size, BLOCK_R=block_r, BLOCK_N=128)
    return out


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(m: int, n_blocks: int, k: int, block_k: int, device: torch.device) -> int:
    """Programs along K: decode-sized batches fill about two programs per SM."""
    if m > 16 or device.type != "cuda":
        return 1
    sms = _sm_count(device.index)
    split = max(1, min(2 * sms // max(n_blocks, 1), k // block_k))
    while (k // block_k) % split:
        split -= 1
    return split


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
    bias: torch.Tensor | None, split_k: int | None = None, dequant_rows: int | None = None,
) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[1]
    if m >= (DEQUANT_ROWS if dequant_rows is None else dequant_rows) and group_size % 8 == 0:
        w = int4_dequantize(qweight, scales, zeros, group_size, x2.dtype)
        out = torch.mm(x2, w) if bias is None else torch.addmm(bias, x2, w)
        return out.reshape(*shape[:-1], n)
    block_k = min(64, group_size)
    block_m, block_n = (16, 64) if m <= 16 else (64, 64)
    n_blocks = triton.cdiv(n, block_n)
    split = split_k or _split_k(m, n_blocks, k, block_k, x.device)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    if m:
        k_per_split = k // split
        _int4_mm_kernel[(triton.cdiv(m, block_m), n_blocks, split)](
            x2, qweight, scales, zeros, out, m, n, k, x2.stride(0), out.stride(0), group_size, k_per_split,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        )
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], n)
