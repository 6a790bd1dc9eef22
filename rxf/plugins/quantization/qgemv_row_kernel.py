"""The quantized decode GEMV for one row of x (batch 1) without `tl.dot`: `qgemv_kernel`'s formats,
grid, K split and epilogue, in the form of `rxf.plugins.models.layers.gemv_row_kernel` (read its
docstring: the weight tile is dequantized and multiplied by x's row element by element in float32
registers, the products summed over K once at the end, the next tile's loads issued before the
current tile's math; no shared memory).

Dequantization is `qgemv_kernel._tile_dot`'s, per element: an int4 code becomes `code - zero` exactly
(the MAGIC bits in x's half precision, then float32), an FP8 value is exact in float32; an int4
group's or FP8 block's scale multiplies its products, FP8 row scales join in the epilogue.

Tested under the Triton interpreter (tests/unit/test_quant_gemv.py); not yet compiled or timed on
the GPU (`benchmarks/gpu_profile.py --phases qgemv` sweeps it): no default uses it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rxf.plugins.models.layers.gemv_kernel import BLOCK_M, finish
from rxf.plugins.quantization.qgemv_kernel import _FP8_BLOCKS, _FP8_ROWS, _INT4, _weight_tile, first_tile


@triton.jit
def _tile_fma(w, scale, zero, x_h, acc, FORMAT: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr):
    """acc + dequant(w) * x_h (x's row chunk in x's dtype: [BLOCK_K], or for INT4 [BLOCK_N, BLOCK_K] with
    every row the same) as float32 [BLOCK_N, BLOCK_K]."""
    x = x_h.to(tl.float32)
    if FORMAT != _INT4:
        x = x[None, :]
    if FORMAT == _INT4:
        shifts = tl.arange(0, 8) * 4
        codes = tl.reshape((w[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        if IEEE:
            dq = codes.to(tl.float32) - zero[:, None]
        else:
            dq = ((codes | MAGIC).to(tl.int16).to(x_h.dtype, bitcast=True) - (zero + OFFSET)[:, None]).to(tl.float32)
        out = acc + dq * x * scale.to(tl.float32)[:, None]
    elif FORMAT == _FP8_BLOCKS:
        out = acc + w.to(tl.float32) * x * scale[:, None]
    else:
        out = acc + w.to(tl.float32) * x
    return out


@triton.jit
def _qgemv_row_kernel(
    X, W, Scales, Zeros, Bias, Out, Partials, Counters, N, K, stride_w, stride_s, stride_om,
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_K: tl.constexpr,
    MAGIC: tl.constexpr, OFFSET: tl.constexpr, PDL: tl.constexpr,
):
    # Pointers advance by a tile's step (not rebuilt from k0): their alignment stays visible to Triton.
    pid_n, pid_k, cols, mask_n, k_lo, k_hi, w_ptrs, w_step, s_ptrs, w, scale, zero = first_tile(
        W, Scales, Zeros, N, K, stride_w, stride_s, FORMAT, BLOCK_N, BLOCK_K, SPLIT_K, SCALE_ROWS, SCALE_K, PDL)
    rows = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # INT4: x's chunk is loaded as a [BLOCK_N, BLOCK_K] tile (each row the same: L1 hits) rather than as
    # one [BLOCK_K] row broadcast to the unpacked codes, whose layout Triton otherwise converts through
    # shared memory on every K step: 12.3 -> 9.0 instructions a weight in the loop's SASS for sm_90 at
    # 32 x 128 tiles (compiled on the CPU box; not yet timed on a GPU). For FP8 the same change costs
    # (6.5 -> 7.4: the weight tile's layout is converted instead), so its x stays one row.
    if FORMAT == _INT4:
        x_ptrs = X + k_lo + offs_k[None, :] + tl.zeros_like(cols)[:, None]
    else:
        x_ptrs = X + k_lo + offs_k
    for k0 in range(k_lo, k_hi, BLOCK_K):  # K is a multiple of BLOCK_K (the wrapper checks)
        ahead = mask_n & (tl.zeros_like(cols) + k0 + BLOCK_K < k_hi)  # issued before the math
        w_ptrs += w_step
        w_next, scale_next, zero_next = _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k0 + BLOCK_K, cols, ahead,
                                                     stride_s, FORMAT, SCALE_K, False)
        acc = _tile_fma(w, scale, zero, tl.load(x_ptrs), acc, FORMAT, IEEE, BLOCK_N, BLOCK_K, MAGIC, OFFSET)
        x_ptrs += BLOCK_K
        w, scale, zero = w_next, scale_next, zero_next
    # Column 0 of a [BLOCK_N, BLOCK_M] tile: the shape `finish` takes (its row 0 is x's only row).
    acc_t = tl.where((rows == 0)[None, :], tl.sum(acc, axis=1)[:, None], 0.0)
    finish(acc_t, acc_t, Bias, Out, Partials, Counters, Scales, cols, rows, mask_n, 1, N, stride_om, pid_n, pid_k,
           BLOCK_N, SPLIT_K, False, HAS_BIAS, FORMAT == _FP8_ROWS)
