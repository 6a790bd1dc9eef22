"""The quantized decode GEMV for one row of x (batch 1) without `tl.dot`: `qgemv_kernel`'s formats,
grid, K split and epilogue, in the form of `rxf.plugins.models.layers.gemv_row_kernel` (read its
docstring: the weight tile is dequantized and multiplied by x's row element by element in float32
registers, the products summed over K once at the end, the next tile's loads issued before the
current tile's math; no shared memory).

Dequantization works on 32-bit words in their stored layout, never on a tile of unpacked codes (whose
reshape Triton lowers through shared memory): a word of eight int4 codes (`_int4_fma`) or four FP8
values (`_fp8_fma`, the FP8 tile read as int32 words) is turned into float32 values that multiply x at
the word's inputs, loaded as one strided vector per position in the word and reused over the rows a
thread holds. Static counts (`benchmarks/sass_count.py`, sm_90), instructions a weight: int4 7.4 ->
4.6 at 128 x 128 tiles (9.0 -> 6.0 at 32 x 128), then 3.9 (5.2) with its two constants passed as
arguments (`_int4_fma`; with the GPU machine's Triton 3.6: 5.2 -> 4.1); FP8 6.5 -> 5.7 at 16 x 256,
3.5 at 32-64 x 256. On the H200 (2026-12-05,
benchmarks/RESULTS.md, before the constants) the
projections of Llama-3-8B at batch 1 then read at 2.6-3.4 TB/s in FP8 (1.6-1.9x bf16 cuBLAS) and
1.0-1.9 TB/s of codes in int4 (1.3-1.7x); the GEMV is the default at batch 1 for every format
(`qgemv.BY_DEFAULT`). An int4 group's or FP8 block's scale multiplies a word's sum, FP8 row scales
join in the epilogue.

With half-precision x, int4 words are dotted two codes an operation in x's dtype (`_int4_pairs_fma`,
3.2 instructions a weight at 128 x 128 / 4 warps, 3.0 at 2 warps); on the H200 (2026-12-06) the
projections then read 1.5-2.6 TB/s of codes at 2 warps, and AWQ decoded at 1.76x bf16 (RESULTS.md).
Each program holds one weight tile ahead of the one it multiplies, or two (`AHEAD`, a row label's
`st`).

An f16x2 dot of FP8 words (two weights an operation) was tried and lost end to end on an H100
(benchmarks/RESULTS.md, 2026-12-06, "FP8 words in f16x2, end to end"), so FP8 stays in float32.

What bounds it (H100, 2026-12-07, RESULTS.md): the block-wise FP8 kernel at its shape defaults reads
at 72-89% of a kernel that only loads the same bytes (`benchmarks/gpu_stream.py`), and is latency-bound,
not issue-bound: at 64 x 128 / 4 warps a thread takes 121 registers, so an SM holds 4 programs and at
most 32 KB of weights in flight, and 62% of a warp's stalls wait on them (Nsight Compute). A tile's
register count and programs a SM: `benchmarks/sass_count.py --regs`.

GATED (`qgemv.QuantGemv.activated`): the SiLU·mul after a `[gate | up]` projection in the same launch,
as the dense GEMV does; each program dots block_n / 2 gate rows and the matching up rows with the same
x, so the grid and a program's bytes are the plain kernel's (on an H100, 2026-12-06, AWQ decoded at
350.5 tok/s against 341.1 with whole tiles of each, 337.9 unfused). The static count a weight: 3.59
-> 3.84 at 64 x 128 int4 / 4 warps (half the rows a thread shares x's pairs over), 4.72 -> 4.78 at
32 x 128 FP8.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rxf.plugins.models.layers.gemv_kernel import program_span
from rxf.plugins.models.layers.gemv_row_kernel import finish_row
from rxf.plugins.quantization.qgemv_kernel import _FP8_BLOCKS, _FP8_ROWS, _INT4, _weight_tile, tile_pointers

# Four E4M3 values (the bytes of an int32 word, lowest first) to float32: two `cvt.rn.f16x2.e4m3x2` (each
# one instruction on sm_90) and four half-to-float conversions, against the byte extracts and re-pairs
# Triton emits for a float8 tile's `.to(float32)` (PRMT, LOP3 and IMAD per value).
_E4M3X4 = tl.constexpr("""{
.reg .b16 lo, hi, e0, e1, e2, e3;
.reg .b32 p, q;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p, lo;
cvt.rn.f16x2.e4m3x2 q, hi;
mov.b32 {e0, e1}, p;
mov.b32 {e2, e3}, q;
cvt.f32.f16 $0, e0;
cvt.f32.f16 $1, e1;
cvt.f32.f16 $2, e2;
cvt.f32.f16 $3, e3;
}""")


@triton.jit
def _fp8_fma(w, scale, xs, acc, FORMAT: tl.constexpr, ASM: tl.constexpr):
    """acc + the FP8 tile w, int32 words `[BLOCK_N, BLOCK_K / 4]` of four inputs each, dotted with x
    word by word: float32 `[BLOCK_N, BLOCK_K / 4]`; xs (`_x_words`) the four float32 `[BLOCK_K / 4]`
    inputs 4r + j of the tile's word columns r. Block scales multiply a word's sum; row scales wait for
    the epilogue. ASM (CUDA): `_E4M3X4` converts; else (Triton's interpreter) each byte is bitcast
    and converted."""
    if ASM:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(_E4M3X4, "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4,
                                                   is_pure=True, pack=1)
    else:
        f0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        f3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if FORMAT == _FP8_BLOCKS:
        t = f0 * xs[0][None, :]
    else:  # row scales: straight into the accumulator
        t = acc + f0 * xs[0][None, :]
    t += f1 * xs[1][None, :]
    t += f2 * xs[2][None, :]
    t += f3 * xs[3][None, :]
    if FORMAT == _FP8_BLOCKS:
        t = acc + t * scale[:, None]
    return t


# An int4 word's dot with bf16 x in bf16x2 arithmetic, for `_int4_pairs_fma`: $1 the word, $2-$5 x's
# pairs (inputs 8r + j, 8r + j + 4 for j = 0..3), $6 the pair (128 + zero, 128 + zero), $7 MASK
# (0x000F000F), $8 MAGIC (128.0's bits in both halves). A shift and a LOP3 put codes j and j + 4 into
# the halves of 128 + code, exactly; the subtraction of 128 + zero is exact (small integers); the
# products and their sum over the word's four pairs round to bf16; the two halves then add and widen
# to float32. 17 instructions for eight weights. bf16 add / sub / mul need sm_90.
_PAIRS_BF16 = tl.constexpr("""{
.reg .b32 c0, c1, c2, c3, d;
.reg .b16 lo, hi;
shr.u32 c1, $1, 4;
shr.u32 c2, $1, 8;
shr.u32 c3, $1, 12;
lop3.b32 c0, $1, $7, $8, 0xEA;
lop3.b32 c1, c1, $7, $8, 0xEA;
lop3.b32 c2, c2, $7, $8, 0xEA;
lop3.b32 c3, c3, $7, $8, 0xEA;
sub.rn.bf16x2 c0, c0, $6;
sub.rn.bf16x2 c1, c1, $6;
sub.rn.bf16x2 c2, c2, $6;
sub.rn.bf16x2 c3, c3, $6;
mul.rn.bf16x2 d, c0, $2;
fma.rn.bf16x2 d, c1, $3, d;
fma.rn.bf16x2 d, c2, $4, d;
fma.rn.bf16x2 d, c3, $5, d;
mov.b32 {lo, hi}, d;
add.rn.bf16 lo, lo, hi;
cvt.f32.bf16 $0, lo;
}""")


# The same for fp16 x, in f16x2 arithmetic, with codes in sixteenths so that no product overflows where
# x does not: $6 / $7 the pairs (64 + zero / 16) and (4 + zero / 16), $8 / $9 MASK and MAGIC for codes
# at bits 0-3 of a half (0x000F000F; 64.0 = 0x5400, whose mantissa steps by 1/16), $10 / $11 for codes
# at bits 4-7 (0x00F000F0; 4.0 = 0x4400, steps of 1/256: a code there counts 16 of them). So
# `(w & MASK) | MAGIC` is 64 + code / 16 (4 + code / 16) exactly, one shift serves four codes, and
# (code - zero) / 16 times x is at most |x|. 15 instructions for eight weights; fp16 rounds products to
# 2^-11.
_PAIRS_F16 = tl.constexpr("""{
.reg .b32 c0, c1, c2, c3, s, d;
.reg .b16 lo, hi;
shr.u32 s, $1, 8;
lop3.b32 c0, $1, $8, $9, 0xEA;
lop3.b32 c1, $1, $10, $11, 0xEA;
lop3.b32 c2, s, $8, $9, 0xEA;
lop3.b32 c3, s, $10, $11, 0xEA;
sub.f16x2 c0, c0, $6;
sub.f16x2 c1, c1, $7;
sub.f16x2 c2, c2, $6;
sub.f16x2 c3, c3, $7;
mul.f16x2 d, c0, $2;
fma.rn.f16x2 d, c1, $3, d;
fma.rn.f16x2 d, c2, $4, d;
fma.rn.f16x2 d, c3, $5, d;
mov.b32 {lo, hi}, d;
add.f16 lo, lo, hi;
cvt.f32.f16 $0, lo;
}""")


@triton.jit
def _half(bits, BF16: tl.constexpr):
    """The low 16 bits of int32 `bits` as a float32 (the half's value)."""
    if BF16:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int4_pairs_fma(w, scale, zero, x_pairs, acc, MASK, MAGIC, OFFSET: tl.constexpr, BF16: tl.constexpr,
                    ASM: tl.constexpr):
    """acc + the int4 words tile w [BLOCK_N, BLOCK_K / 8] dotted with half-precision x, two codes per
    operation: float32 [BLOCK_N, BLOCK_K / 8]. x_pairs (`_x_words`): four int32 [BLOCK_K / 8], the
    halves (x[8r + j], x[8r + j + 4]) for the tile's word rows r, the pairs that a word's halves hold
    after `(w >> 4j) & MASK`.

    Against `_int4_fma` (float32, one code an operation: 4.13 instructions a weight by the static count
    at 128 x 128 / 4 warps under the GPU's Triton 3.6) the word's dot runs in x's dtype two codes at a
    time (`_PAIRS_BF16`: 3.18; `_PAIRS_F16`), then one float32 FMA takes it into the accumulator with
    the group's scale. The price is rounding: each product and partial sum rounds to x's precision
    (bf16 2^-9, fp16 2^-11) before float32 takes over, eight products a word (tests/gpu hold the
    GEMV within 1% relative error at every Llama-3-8B shape; `gpu_qgemv.py` records each setting's
    error). fp16 codes count in sixteenths (OFFSET 64, UNIT 1/16; bf16: 128 and 1): `(OFFSET + code *
    UNIT) - (OFFSET + zero * UNIT)` is exact and 1/UNIT comes back with the scale. ASM off (Triton's
    interpreter) computes the same pairing in float32: the CPU tests check the indexing and the units,
    the GPU tests the arithmetic."""
    if BF16:  # UNIT 1
        z_value = zero.to(tl.float32) + OFFSET
        z = z_value.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        unscale = scale
    else:  # UNIT 1/16
        z_value = zero.to(tl.float32) * 0.0625 + OFFSET
        z = z_value.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        unscale = scale.to(tl.float32) * 16.0
    if ASM and BF16:
        args = [w, x_pairs[0][None, :], x_pairs[1][None, :], x_pairs[2][None, :], x_pairs[3][None, :],
                (z | (z << 16))[:, None], MASK + tl.zeros_like(w), MAGIC + tl.zeros_like(w)]
        t = tl.inline_asm_elementwise(_PAIRS_BF16, "=r,r,r,r,r,r,r,r,r", args, dtype=tl.float32, is_pure=True,
                                      pack=1)
    elif ASM:  # codes at bits 4-7 of a half: MASK << 4, and 4.0 for 64.0 (an exponent 4 lower)
        z_hi = (z_value - 60.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        args = [w, x_pairs[0][None, :], x_pairs[1][None, :], x_pairs[2][None, :], x_pairs[3][None, :],
                (z | (z << 16))[:, None], (z_hi | (z_hi << 16))[:, None], MASK + tl.zeros_like(w),
                MAGIC + tl.zeros_like(w), (MASK << 4) + tl.zeros_like(w), (MAGIC - 0x10001000) + tl.zeros_like(w)]
        t = tl.inline_asm_elementwise(_PAIRS_F16, "=r,r,r,r,r,r,r,r,r,r,r,r", args, dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        zf = _half(z, BF16)[:, None]
        t = tl.zeros_like(acc)
        for j in tl.static_range(4):
            codes = ((w >> (4 * j)) & MASK) | MAGIC
            xp = x_pairs[j][None, :]
            t += (_half(codes, BF16) - zf) * _half(xp, BF16) + (_half(codes >> 16, BF16) - zf) * _half(xp >> 16, BF16)
    return acc + t * unscale.to(tl.float32)[:, None]


@triton.jit
def _int4_fma(w, scale, zero, xs, acc, MASK, MAGIC):
    """acc + the int4 words tile w [BLOCK_N, BLOCK_K / 8] dotted with x, word by word: float32
    [BLOCK_N, BLOCK_K / 8]. xs (`_x_words`): the eight float32 [BLOCK_K / 8] inputs 8r + j of the
    tile's word rows r.

    No code is unpacked into a tile of its own and nothing is converted from an integer: code j of
    every word is moved to bits 16..19 and OR-ed into the bits of 128.0 (float32 0x43000000, whose
    mantissa counts 1 there), so f_j = 128 + code_j exactly, a shift and a LOP3 per weight. A word's
    t = sum_j f_j * x[8r + j] then gives its dot with the dequantized codes as t - (128 + zero) *
    sum_j x[8r + j] (the tile lies in one group: one zero and one scale per row), scaled once. All
    of it is elementwise on the words' own layout: no reshape, no shared memory.

    MASK (0x000F0000) and MAGIC (0x43000000) arrive as kernel arguments, not literals: LOP3 takes one
    immediate, and ptxas re-materialized the other literal into a register (IMAD.MOV / MOV) before
    most uses, ~100 of the loop's ~590 instructions at 128 x 128 / 4 warps; an argument sits in a
    uniform register that LOP3 reads directly (`benchmarks/sass_count.py`: 4.58 -> 3.88 a weight; under
    the GPU machine's Triton 3.6, 5.22 -> 4.13)."""
    t = tl.zeros_like(acc)
    x_sum = tl.zeros_like(xs[0])
    for j in tl.static_range(8):
        x_j = xs[j]
        if j < 4:
            moved = w << (16 - 4 * j)
        elif j == 4:
            moved = w
        else:
            moved = w >> (4 * j - 16)  # arithmetic: the sign bits land above bit 19, masked off
        f = ((moved & MASK) | MAGIC).to(tl.float32, bitcast=True)
        t += f * x_j[None, :]
        x_sum += x_j
    offset = zero.to(tl.float32) + 128.0
    return acc + scale.to(tl.float32)[:, None] * (t - offset[:, None] * x_sum[None, :])


@triton.jit
def _x_words(x_ptrs, FORMAT: tl.constexpr, PAIRS: tl.constexpr):
    """x's inputs for a tile, as its word-wise dot takes them, from `x_ptrs` (one per word column r of
    the tile): PAIRS (int4, half x; x read as int32 words, two inputs each, pointing at inputs 8r and
    8r + 1) four int32, the halves (x[8r + j], x[8r + j + 4]) (`_int4_pairs_fma`); int4 (pointing at
    x[8r]) eight float32, inputs 8r + j (`_int4_fma`); FP8 (at x[4r]) four float32, inputs 4r + j
    (`_fp8_fma`)."""
    if PAIRS:  # re-paired from the words
        a = tl.load(x_ptrs)
        b = tl.load(x_ptrs + 1)
        c = tl.load(x_ptrs + 2)
        d = tl.load(x_ptrs + 3)
        xw = ((a & 0xFFFF) | (c << 16), ((a >> 16) & 0xFFFF) | (c & -65536),
              (b & 0xFFFF) | (d << 16), ((b >> 16) & 0xFFFF) | (d & -65536))
    elif FORMAT == _INT4:
        xw = (tl.load(x_ptrs).to(tl.float32), tl.load(x_ptrs + 1).to(tl.float32),
              tl.load(x_ptrs + 2).to(tl.float32), tl.load(x_ptrs + 3).to(tl.float32),
              tl.load(x_ptrs + 4).to(tl.float32), tl.load(x_ptrs + 5).to(tl.float32),
              tl.load(x_ptrs + 6).to(tl.float32), tl.load(x_ptrs + 7).to(tl.float32))
    else:
        xw = (tl.load(x_ptrs).to(tl.float32), tl.load(x_ptrs + 1).to(tl.float32),
              tl.load(x_ptrs + 2).to(tl.float32), tl.load(x_ptrs + 3).to(tl.float32))
    return xw


@triton.jit
def _word_dot(w, scale, zero, xw, acc, MASK, MAGIC, FORMAT: tl.constexpr, PAIRS: tl.constexpr,
              OFFSET: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """acc + the tile w (with its scale and zero) dotted with `_x_words`' xw, by the format's dot."""
    if PAIRS:
        out = _int4_pairs_fma(w, scale, zero, xw, acc, MASK, MAGIC, OFFSET, BF16, ASM)
    elif FORMAT == _INT4:
        out = _int4_fma(w, scale, zero, xw, acc, MASK, MAGIC)
    else:
        out = _fp8_fma(w, scale, xw, acc, FORMAT, ASM)
    return out


@triton.jit
def _qgemv_row_kernel(
    X, W, Scales, Zeros, Bias, Out, Partials, Counters, N, K, stride_w, stride_s, stride_om, MASK, MAGIC,
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr, PAIRS: tl.constexpr = False, OFFSET: tl.constexpr = 0.0, BF16: tl.constexpr = False,
    AHEAD: tl.constexpr = 1, GATED: tl.constexpr = False,
):
    # N: the output columns. GATED: W holds 2N rows [gate | up] (int4: 2N columns of words), the output is
    # silu(gate) * up; each program reads its gate rows' tile and its up rows' tile (rows N + cols) and
    # dots both with the same x.
    pid_n, pid_k, cols, mask_n, k_lo, k_hi = program_span(N, K, BLOCK_N, BLOCK_K, SPLIT_K)
    w_ptrs, w_step, s_ptrs = tile_pointers(W, Scales, cols, k_lo, stride_w, stride_s, FORMAT, BLOCK_K, SCALE_ROWS,
                                           FORMAT != _INT4)
    # Weights are fixed at load: the first tiles are read before waiting for the kernel that writes x.
    # An empty K range (the last split may be) reads zeros, scales included. (Vector compares: Triton's
    # interpreter rejects a mask broadcast from a scalar.)
    first_ok = mask_n & (tl.zeros_like(cols) + k_lo < k_hi)
    w, scale, zero = _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k_lo, cols, first_ok, stride_s, FORMAT, SCALE_K,
                                  False)
    if GATED:
        u_ptrs, _, u_s_ptrs = tile_pointers(W, Scales, cols + N, k_lo, stride_w, stride_s, FORMAT, BLOCK_K,
                                            SCALE_ROWS, FORMAT != _INT4)
        u, u_scale, u_zero = _weight_tile(u_ptrs, Scales, Zeros, u_s_ptrs, k_lo, cols + N, first_ok, stride_s,
                                          FORMAT, SCALE_K, False)
    # AHEAD tiles are in flight while one is multiplied (the label's `st`: 1, or 2 for more bytes in
    # flight per program); each is read as zeros past k_hi. Pointers advance by a tile's step (not
    # rebuilt from k0): their alignment stays visible to Triton.
    w_1, scale_1, zero_1 = w, scale, zero
    if GATED:
        u_1, u_scale_1, u_zero_1 = u, u_scale, u_zero
    if AHEAD == 2:  # the second tile too is read before the wait
        k_1 = k_lo + BLOCK_K
        ok_1 = mask_n & (tl.zeros_like(cols) + k_1 < k_hi)
        w_ptrs += w_step
        w_1, scale_1, zero_1 = _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k_1, cols, ok_1, stride_s, FORMAT,
                                            SCALE_K, False)
        if GATED:
            u_ptrs += w_step
            u_1, u_scale_1, u_zero_1 = _weight_tile(u_ptrs, Scales, Zeros, u_s_ptrs, k_1, cols + N, ok_1, stride_s,
                                                    FORMAT, SCALE_K, False)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # x's pointers, one per word column of the tile, advanced by a tile's step (`_x_words`)
    x_step = BLOCK_K
    if PAIRS:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        x_ptrs = X.to(tl.pointer_type(tl.int32)) + k_lo // 2 + 4 * tl.arange(0, BLOCK_K // 8)
        x_step = BLOCK_K // 2
    elif FORMAT == _INT4:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        x_ptrs = X + k_lo + 8 * tl.arange(0, BLOCK_K // 8)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
        x_ptrs = X + k_lo + 4 * tl.arange(0, BLOCK_K // 4)
    acc_up = acc
    for k0 in range(k_lo, k_hi, BLOCK_K):  # K is a multiple of BLOCK_K (the wrapper checks)
        k_next = k0 + AHEAD * BLOCK_K
        ok_next = mask_n & (tl.zeros_like(cols) + k_next < k_hi)
        w_ptrs += w_step
        w_next, scale_next, zero_next = _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k_next, cols, ok_next, stride_s,
                                                     FORMAT, SCALE_K, False)  # issued before the math
        if GATED:
            u_ptrs += w_step
            u_next, u_scale_next, u_zero_next = _weight_tile(u_ptrs, Scales, Zeros, u_s_ptrs, k_next, cols + N,
                                                             ok_next, stride_s, FORMAT, SCALE_K, False)
        xw = _x_words(x_ptrs, FORMAT, PAIRS)
        x_ptrs += x_step
        acc = _word_dot(w, scale, zero, xw, acc, MASK, MAGIC, FORMAT, PAIRS, OFFSET, BF16, ASM)
        if GATED:
            acc_up = _word_dot(u, u_scale, u_zero, xw, acc_up, MASK, MAGIC, FORMAT, PAIRS, OFFSET, BF16, ASM)
        if AHEAD == 2:
            w, scale, zero = w_1, scale_1, zero_1
            w_1, scale_1, zero_1 = w_next, scale_next, zero_next
            if GATED:
                u, u_scale, u_zero = u_1, u_scale_1, u_zero_1
                u_1, u_scale_1, u_zero_1 = u_next, u_scale_next, u_zero_next
        else:
            w, scale, zero = w_next, scale_next, zero_next
            if GATED:
                u, u_scale, u_zero = u_next, u_scale_next, u_zero_next
    finish_row(acc, acc_up, Bias, Out, Partials, Counters, Scales, cols, mask_n, N, stride_om, pid_n, pid_k, BLOCK_N,
               SPLIT_K, GATED, HAS_BIAS, FORMAT == _FP8_ROWS)
