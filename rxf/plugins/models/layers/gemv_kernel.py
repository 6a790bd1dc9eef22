"""A skinny GEMM for decode, `out[m] = x[m] @ W.T` with m <= 16 rows, in one launch, split over K with
the reduction fused; optionally SiLU·mul of a fused `[gate | up]` projection, or float32 output.

At batch 1-8 a projection is a pure weight stream. cuBLAS reads the narrow ones (qkv 6144x4096, o_proj
4096x4096) well below the copy bandwidth, and splits o_proj over K with a separate reduce kernel.
Here W streams through `tl.dot` tiles (so Triton's software pipeline keeps `num_stages` tiles in
flight per program); the rows of x are padded to one 16-row tile, which costs no extra weight traffic.

Grid: (n_blocks, SPLIT_K). Program (b, s) owns output columns [b * BLOCK_N, (b + 1) * BLOCK_N) and the
K range [s * k_span, (s + 1) * k_span) (k_span a multiple of BLOCK_K; the last range may be shorter
or empty). With SPLIT_K > 1 each program writes its float32 partial tile to
`partials[b, s]`, then increments `counters[b]`; the program that sees the count reach SPLIT_K - 1
is the last of its column block: it sums the SPLIT_K partials in a fixed order (results do not depend
on which program finishes last), applies the epilogue, and resets `counters[b]` to 0 for the next
launch. Invariant between launches: every counter is 0 (they start zeroed and each launch restores
them), so one buffer serves every call of a layer, eager or replayed from a CUDA graph.

Memory ordering of that hand-off: the block's threads finish their partial stores, a CTA barrier
orders them before the counter's acq_rel atomic (release for the writer, acquire for the last
program), and the last program reads the partials with `.cg` loads (from L2, not a stale L1).

GATED (for `[gate | up]` weights of 2 * n_out rows): each program streams the gate rows of its
columns and the matching up rows (offset n_out), and the epilogue writes silu(gate) * up.

The pre-norm block's residual add and RMSNorm once went into the projection after it (each program
read its rows of h and r whole for the row's rstd, then normed its x tiles): one launch a norm fewer,
yet on an H100 every call was slower than the norm kernel and the GEMV apart (Llama-3-8B's qkv 2.8 us
at 1 row, 4.9 at 4; batch-1 decode 0.8% (Llama-3-8B) and 2.2% (Qwen3-8B) faster without it;
benchmarks/RESULTS.md 2026-12-06), so it was removed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl

ROWS = 16  # rows of x per tile: the smallest tl.dot tile; rows past M are masked to zero
BLOCK_M = tl.constexpr(ROWS)  # the same, as the kernels see it (a global must be a constexpr there)


@triton.jit
def _mma(w, x_t, acc, IEEE: tl.constexpr):
    """acc + w @ x_t; IEEE keeps float32 inputs in full precision (tl.dot would use TF32)."""
    if IEEE:
        return tl.dot(w, x_t, acc, input_precision="ieee")
    return tl.dot(w, x_t, acc)


@triton.jit
def _gemv_kernel(
    X, W, Bias, Out, Partials, Counters, M, N_OUT, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    pid_n, pid_k, cols, mask_n, k_lo, k_hi = program_span(N_OUT, K, BLOCK_N, BLOCK_K, SPLIT_K)
    rows = tl.arange(0, BLOCK_M)  # rows of x
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = W + cols.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = X + rows[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up_offset = N_OUT.to(tl.int64) * stride_wn
    # The first K tile is peeled off the loop: its weights (fixed at load) are read before waiting
    # for the kernel that writes x, so under PDL the weight stream starts while that kernel runs.
    # An empty K range (the last split may be) loads zeros.
    # (vector compares: Triton's interpreter rejects a mask broadcast from a scalar)
    first_n = mask_n & (tl.zeros_like(cols) + k_lo < k_hi)
    w = tl.load(w_ptrs, mask=first_n[:, None], other=0.0)
    if GATED:
        u = tl.load(w_ptrs + up_offset, mask=first_n[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x_t = tl.trans(tl.load(x_ptrs, mask=((rows < M) & (tl.zeros_like(rows) + k_lo < k_hi))[:, None], other=0.0))
    acc = _mma(w, x_t, acc, IEEE)
    if GATED:
        acc_up = _mma(u, x_t, acc_up, IEEE)
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for _ in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # K is a multiple of BLOCK_K (the wrapper checks)
        x_t = tl.trans(tl.load(x_ptrs, mask=(rows < M)[:, None], other=0.0))
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        acc = _mma(w, x_t, acc, IEEE)
        if GATED:
            if EVEN_N:
                u = tl.load(w_ptrs + up_offset)
            else:
                u = tl.load(w_ptrs + up_offset, mask=mask_n[:, None], other=0.0)
            acc_up = _mma(u, x_t, acc_up, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    # (Out stands in for the row scales, which a dense weight does not have.)
    finish(acc, acc_up, Bias, Out, Partials, Counters, Out, cols, rows, mask_n, M, N_OUT, stride_om, pid_n, pid_k,
           BLOCK_N, SPLIT_K, GATED, HAS_BIAS, False)


@triton.jit
def program_span(N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's (pid_n, pid_k, output columns, their mask < N, K range [k_lo, k_hi)) in the
    grid of the module docstring."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_span
    return pid_n, pid_k, cols, cols < N, k_lo, tl.minimum(k_lo + k_span, K)


@triton.jit
def finish(acc, acc_up, Bias, Out, Partials, Counters, RowScale, cols, rows, mask_n, M, N_OUT, stride_om,
           pid_n, pid_k, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GATED: tl.constexpr,
           HAS_BIAS: tl.constexpr, ROW_SCALED: tl.constexpr):
    """The end of a program that holds the float32 `acc` [BLOCK_N, BLOCK_M] (and `acc_up`) of its
    columns over its K range: with SPLIT_K > 1 the counter hand-off of the module docstring, then
    the epilogue, in the last program of the column block. Shared by every GEMV kernel (the
    quantized ones in `rxf.plugins.quantization.qgemv_kernel` too); ROW_SCALED: the epilogue
    multiplies by `RowScale[cols]` (FP8 row scales) before the bias.

    A partial tile is stored row by row of x (`rows * BLOCK_N + column`) and only for the M real
    rows, so a batch-1 split writes and reads BLOCK_N floats per program, not the padded 16 rows."""
    tile = rows[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    real = (rows < M)[None, :]
    if SPLIT_K > 1:
        TILES: tl.constexpr = 2 if GATED else 1
        base = Partials + (pid_n * SPLIT_K + pid_k).to(tl.int64) * (TILES * BLOCK_N * BLOCK_M)
        tl.store(base + tile, acc, mask=real)
        if GATED:
            tl.store(base + BLOCK_N * BLOCK_M + tile, acc_up, mask=real)
        tl.debug_barrier()  # every thread's partial stores precede the counter update
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last program of this column block reduces
            first = Partials + pid_n.to(tl.int64) * (SPLIT_K * TILES * BLOCK_N * BLOCK_M)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part = first + s * (TILES * BLOCK_N * BLOCK_M)
                acc += tl.load(part + tile, mask=real, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part + BLOCK_N * BLOCK_M + tile, mask=real, other=0.0, cache_modifier=".cg")
            tl.store(Counters + pid_n, 0)
            _epilogue(acc, acc_up, Bias, Out, RowScale, cols, rows, mask_n, M, N_OUT, stride_om, GATED, HAS_BIAS,
                      ROW_SCALED)
    else:
        _epilogue(acc, acc_up, Bias, Out, RowScale, cols, rows, mask_n, M, N_OUT, stride_om, GATED, HAS_BIAS,
                  ROW_SCALED)


@triton.jit
def _epilogue(acc, acc_up, Bias, Out, RowScale, cols, rows, mask_n, M, N_OUT, stride_om,
              GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SCALED: tl.constexpr):
    """out[rows, cols] = acc.T (* row scale) (+ bias), or silu(gate) * up; float32 until the one rounding."""
    if ROW_SCALED:
        acc *= tl.load(RowScale + cols, mask=mask_n, other=0.0)[:, None]
        if GATED:
            acc_up *= tl.load(RowScale + N_OUT + cols, mask=mask_n, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(Bias + N_OUT + cols, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    out_ptrs = Out + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=(rows < M)[None, :] & mask_n[:, None])


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
    block_n: int, block_k: int, split_k: int, num_stages: int, num_warps: int,
    gated: bool = False, out_dtype: torch.dtype | None = None, row: bool = False, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` for x [m <= 16, K] (contiguous rows), weight [N, K] (K contiguous), in
    out_dtype (default x's); gated: weight is `[gate | up]` and the result silu(gate) * up, [m, N / 2];
    row: one row of x goes through `gemv_row_kernel` (num_stages unused), more rows through this module's
    kernel; `out`: the tensor `[m, N_out]` of that dtype, contiguous, to write (default a new one).
    `counters`: int32, at least cdiv(N_out, block_n) zeros, left zeroed (see the module docstring)."""
    m, k = x.shape
    n = weight.shape[0]
    n_out = n // 2 if gated else n
    assert m <= ROWS, f"{m} rows: the GEMV takes at most {ROWS}"
    assert weight.shape[1] == k and k % block_k == 0, f"K {k} must be a multiple of block_k {block_k}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need contiguous rows"
    n_blocks = triton.cdiv(n_out, block_n)
    assert counters.numel() >= n_blocks, f"{counters.numel()} counters for {n_blocks} column blocks"
    if out is None:
        out = torch.empty(m, n_out, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (m, n_out) and out.dtype == (out_dtype or x.dtype) and out.is_contiguous(), (
        f"out {tuple(out.shape)} {out.dtype} for [{m}, {n_out}] {out_dtype or x.dtype}, contiguous")
    tiles = 2 if gated else 1
    pdl = use_pdl(x)
    partials = (torch.empty(n_blocks * split_k * tiles * block_n * ROWS, dtype=torch.float32, device=x.device)
                if split_k > 1 else out)  # unused without a split
    if row and m == 1:
        from rxf.plugins.models.layers.gemv_row_kernel import _gemv_row_kernel

        _gemv_row_kernel[(n_blocks, split_k)](
            x, weight, bias if bias is not None else out, out, partials, counters, n_out, k, weight.stride(0),
            out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, GATED=gated, HAS_BIAS=bias is not None,
            PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
        )
        return out
    _gemv_kernel[(n_blocks, split_k)](
        x, weight, bias if bias is not None else out, out, partials, counters, m, n_out, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, GATED=gated, HAS_BIAS=bias is not None,
        EVEN_N=n_out % block_n == 0, IEEE=x.dtype == torch.float32, PDL=pdl,
        num_stages=num_stages, num_warps=num_warps, launch_pdl=pdl,
    )
    return out
