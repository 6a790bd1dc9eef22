"""The FP8 decode GEMV for one row of x (batch 1) with its weight tiles read by the tensor memory
accelerator: `qgemv_row_kernel`'s formats (`fp8`, `fp8-block`), grid, K split, word-wise dot
(`_fp8_fma`) and epilogue (`finish_row`), with the weight reaching the program through a host tensor
descriptor (`desc`, the weight's `[N, K / 4]` int32 words, one `[BLOCK_N, BLOCK_K / 4]` box a tile) and
Triton's software pipeline (`STAGES` tiles in shared memory, STAGES - 1 of them in flight while one
is multiplied). Label prefix `t` on a row label (`RXF_QGEMV`, `qgemv.QuantSettings`): `trn32k128s5st4w4`.

Why: the register-fed row kernel holds its bytes in flight in registers: at 64 x 128 / 4 warps a
thread takes 121 registers, so an SM holds 4 programs and at most 32 KB of weight loads in flight, and
Nsight Compute found it latency-bound (benchmarks/RESULTS.md, 2026-12-07). Here the tiles in flight
sit in shared memory (TMA writes them, an mbarrier says when) and cost no registers: compiled for sm_90
by Triton 3.6 (`benchmarks/sass_count.py --kernel fp8-block-tma --regs`), 64 x 128 / 4 warps at 3
stages takes 56 registers, 16 KB, 9 programs a SM with 2 tiles each in flight; 32 x 128 / 4 warps at
4 stages 42 registers, 12 KB, 10 a SM; 4.4-5.9 instructions a weight in the loop against the register
kernel's 4.3-4.7.

Measured (H100, 2026-12-07, RESULTS.md): it does not read faster. Block-wise FP8 at Llama-3-8B's
shapes, the best TMA label against the best register label: qkv 13.49 against 13.18 us, o 10.86
against 10.35, gate_up 46.28 against 46.59, down 26.02 against 25.43; batch-1 decode with every
projection on TMA tiles 256.7-258.7 tok/s against 269.9 at the register defaults. So more bytes in
flight alone does not close the gap to a pure read. It ties at gate_up, whose sm_90 default names it
(`qgemv.SHAPE_DEFAULTS`).

With programmatic dependent launch the pipeline's prologue (the first STAGES - 1 tiles, and the
block scales, which the pipeline copies with cp.async) is issued before `gdc_wait`, which sits in the
loop ahead of x's loads: weights and scales are fixed at load, x is the previous kernel's output.
Rows past N read as zeros (TMA fills a box's out-of-bounds part); the pipeline predicates off the
prologue's loads for tiles past the program's K span (an empty span, the last split's, reads none).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl
from rxf.plugins.models.layers.gemv_kernel import program_span
from rxf.plugins.models.layers.gemv_row_kernel import finish_row
from rxf.plugins.quantization.qgemv_kernel import _FP8_BLOCKS, _FP8_ROWS, FP8_BLOCKS, FP8_ROWS, partials_for
from rxf.plugins.quantization.qgemv_row_kernel import _fp8_fma, _x_words


@triton.jit
def _qgemv_tma_kernel(
    X, desc, Scales, Bias, Out, Partials, Counters, N, K, stride_s, stride_om,
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr, STAGES: tl.constexpr,
):
    pid_n, pid_k, cols, mask_n, k_lo, k_hi = program_span(N, K, BLOCK_N, BLOCK_K, SPLIT_K)
    s_ptrs = Scales + (cols // SCALE_ROWS).to(tl.int64) * stride_s
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    x_ptrs = X + k_lo + 4 * tl.arange(0, BLOCK_K // 4)  # one per word column of the tile (`_x_words`)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):  # K is a multiple of BLOCK_K
        w = desc.load([pid_n * BLOCK_N, k0 // 4])
        if FORMAT == _FP8_BLOCKS and SCALE_ROWS % BLOCK_N == 0:  # one scale for the tile: a scalar load
            scale = tl.zeros_like(cols).to(tl.float32) + tl.load(
                Scales + (pid_n * BLOCK_N // SCALE_ROWS) * stride_s + k0 // SCALE_K)
        elif FORMAT == _FP8_BLOCKS:
            scale = tl.load(s_ptrs + k0 // SCALE_K, mask=mask_n, other=0.0)
        else:  # row scales join in the epilogue
            scale = tl.zeros_like(cols).to(tl.float32)
        if PDL:  # after the prologue's weight reads, before x's (a no-op once the producer is done)
            tl.extra.cuda.gdc_wait()
        xw = _x_words(x_ptrs, FORMAT, False)
        x_ptrs += BLOCK_K
        acc = _fp8_fma(w, scale, xw, acc, FORMAT, ASM)
    finish_row(acc, acc, Bias, Out, Partials, Counters, Scales, cols, mask_n, N, stride_om, pid_n, pid_k, BLOCK_N,
               SPLIT_K, False, HAS_BIAS, FORMAT == _FP8_ROWS)


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int):
    """The host tensor descriptor of an FP8 weight `[N, K]` as `[N, K / 4]` int32 words in boxes of
    `[block_n, block_k / 4]`. ValueError where TMA cannot read it: its start or row stride not a
    multiple of 16 bytes, a row not whole words, or a box row under 16 bytes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if (weight.data_ptr() % 16 or weight.stride(0) % 16 or weight.stride(1) != 1 or weight.shape[1] % 4
            or block_k < 16):
        raise ValueError(f"TMA reads 16-byte aligned rows and boxes: weight {tuple(weight.shape)} with strides "
                         f"{weight.stride()}, block_k {block_k}")
    words = weight.view(torch.int32)
    return TensorDescriptor(words, list(words.shape), [weight.stride(0) // 4, 1], [block_n, block_k // 4])


def qgemv_tma(x: torch.Tensor, fmt: int, desc, n: int, scales: torch.Tensor, bias: torch.Tensor | None,
              counters: torch.Tensor, *, scale_rows: int, scale_k: int, block_n: int, block_k: int, split_k: int,
              num_stages: int, num_warps: int) -> torch.Tensor:
    """`x @ dequant(weight).T + bias` for one row of half-precision x `[1, K]`, the weight given by
    `weight_descriptor` (boxes of block_n x block_k), as `qgemv_kernel.qgemv` computes it."""
    assert fmt in (FP8_ROWS, FP8_BLOCKS), "TMA reads the FP8 formats"
    assert x.shape[0] == 1 and x.stride(1) == 1 and num_stages >= 2, "one contiguous row, two stages or more"
    k = x.shape[1]
    assert k % block_k == 0 and scale_k % block_k == 0 and list(desc.block_shape) == [block_n, block_k // 4]
    n_blocks = triton.cdiv(n, block_n)
    assert counters.numel() >= n_blocks, f"{counters.numel()} counters for {n_blocks} column blocks"
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    _qgemv_tma_kernel[(n_blocks, split_k)](
        x, desc, scales, bias if bias is not None else out, out, partials_for(out, n_blocks, split_k, block_n),
        counters, n, k, scales.stride(0) if scales.dim() == 2 else 0, out.stride(0), FORMAT=fmt, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None, SCALE_ROWS=scale_rows, SCALE_K=scale_k,
        PDL=pdl, ASM=x.is_cuda, STAGES=num_stages, num_warps=num_warps, launch_pdl=pdl,
    )
    return out
