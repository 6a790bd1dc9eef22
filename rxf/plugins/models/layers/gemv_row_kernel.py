"""The decode GEMV for one row of x (batch 1) without `tl.dot`: each program multiplies its weight tile by
x's row element by element in float32 registers and sums the products over K once, at the end.

`gemv_kernel._gemv_kernel` pads x to a 16-row tile for `tl.dot` so that Triton's software pipeline
streams the weights through shared memory, `num_stages` tiles deep; at batch 1 its projections read
at 3.0-3.6 TB/s where a 1 GiB copy reads and writes at ~4.2 (benchmarks/RESULTS.md, issue 17). This
kernel needs no shared memory: each program holds two weight tiles in registers (the one it
multiplies and the next one, whose load it issues first), so many programs fit on an SM and the
memory system sees their loads in flight together. Which kernel serves a projection is a setting
(`GemvSettings.row`), chosen by measurement (`benchmarks/gpu_profile.py --phases gemv`). On the H200
(2026-12-05, benchmarks/RESULTS.md) its best settings beat the tile kernel's default alone (Llama-3-8B
qkv 15.8 -> 15.1 us, gate_up 65.0 -> 61.7, down 32.5 -> 29.1), yet not in a whole batch-1 step under
PDL (218.0 vs 218.1 tok/s); at Qwen3-30B-A3B's narrower shapes it did (H100, 279.0 -> 283.2 tok/s),
so those shapes take it by default (`gemv.SHAPE_DEFAULTS`), and Qwen3-8B's gate_up.

Grid, K split, split-K hand-off and epilogue are `gemv_kernel`'s (`program_span`, `finish`), as is
GATED; only M == 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rxf.plugins.models.layers.gemv_kernel import BLOCK_M, finish, program_span


@triton.jit
def _tile(w_ptrs, up_offset, k0, k_hi, mask_n, GATED: tl.constexpr):
    """The weight tile at `w_ptrs` (K offset k0; and its up rows), zeros past k_hi. The pointers advance
    by BLOCK_K per tile rather than being rebuilt from k0, which keeps their 16-byte alignment
    visible to Triton (vector loads)."""
    ok = mask_n & (tl.zeros_like(mask_n.to(tl.int32)) + k0 < k_hi)
    w = tl.load(w_ptrs, mask=ok[:, None], other=0.0)
    u = w
    if GATED:
        u = tl.load(w_ptrs + up_offset, mask=ok[:, None], other=0.0)
    return w, u


@triton.jit
def _gemv_row_kernel(
    X, W, Bias, Out, Partials, Counters, N_OUT, K, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    pid_n, pid_k, cols, mask_n, k_lo, k_hi = program_span(N_OUT, K, BLOCK_N, BLOCK_K, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    up_offset = N_OUT.to(tl.int64) * stride_wn
    # Weights are fixed at load: the first tile is read before waiting for the kernel that writes x.
    w, u = _tile(w_ptrs, up_offset, k_lo, k_hi, mask_n, GATED)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    x_offs = k_lo + offs_k
    for k0 in range(k_lo, k_hi, BLOCK_K):  # K is a multiple of BLOCK_K (the wrapper checks)
        w_ptrs += BLOCK_K
        w_next, u_next = _tile(w_ptrs, up_offset, k0 + BLOCK_K, k_hi, mask_n, GATED)  # issued before the math
        x = tl.load(X + x_offs).to(tl.float32)
        x_offs += BLOCK_K
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            acc_up += u.to(tl.float32) * x[None, :]
        w, u = w_next, u_next
    finish_row(acc, acc_up, Bias, Out, Partials, Counters, Out, cols, mask_n, N_OUT, stride_om, pid_n, pid_k, BLOCK_N,
               SPLIT_K, GATED, HAS_BIAS, False)


@triton.jit
def finish_row(acc, acc_up, Bias, Out, Partials, Counters, RowScale, cols, mask_n, N_OUT, stride_om, pid_n, pid_k,
               BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
               ROW_SCALED: tl.constexpr):
    """`finish` for a row kernel's float32 accumulators `[BLOCK_N, *]` (and `acc_up`, GATED): each row's
    sum becomes column 0 of the `[BLOCK_N, BLOCK_M]` tile `finish` takes (its row 0 is x's only row)."""
    rows = tl.arange(0, BLOCK_M)
    first = (rows == 0)[None, :]
    acc_t = tl.where(first, tl.sum(acc, axis=1)[:, None], 0.0)
    acc_up_t = acc_t
    if GATED:
        acc_up_t = tl.where(first, tl.sum(acc_up, axis=1)[:, None], 0.0)
    finish(acc_t, acc_up_t, Bias, Out, Partials, Counters, RowScale, cols, rows, mask_n, 1, N_OUT, stride_om, pid_n,
           pid_k, BLOCK_N, SPLIT_K, GATED, HAS_BIAS, ROW_SCALED)
