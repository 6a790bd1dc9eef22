"""The decode GEMV of quantized weights: `out[m] = x[m] @ dequant(W).T (+ bias)` for m <= 16 rows, in
one launch, weight-only (w8a16 / w4a16: x stays in its half precision, nothing quantizes it).

The design is `rxf.plugins.models.layers.gemv_kernel`'s (read its docstring): grid (n_blocks,
SPLIT_K), program (b, s) owns output columns [b * BLOCK_N, (b + 1) * BLOCK_N) and one K range, x's
rows padded to one 16-row `tl.dot` tile, and the split-K partials, counters, fixed-order reduction
and epilogue of its `finish` helper. Only the weight tile differs: it is read in its stored form and
dequantized in registers, inside the K loop.

FORMAT (constexpr):
  FP8_ROWS    W float8_e4m3fn `[N, K]` (K contiguous), float32 `Scales[N]` (one per output row:
              online FP8, compressed-tensors per channel, per tensor broadcast to rows). A
              `[BLOCK_N, BLOCK_K]` tile is upcast to x's dtype (`.to`, exact: every E4M3 value is
              a bf16 / fp16) and dotted with x; the row scale multiplies once, in the epilogue.
  FP8_BLOCKS  W as above, float32 `Scales[ceil(N / SCALE_ROWS), ceil(K / SCALE_K)]`: the
              checkpoint's 128 x 128 block scales (SCALE_ROWS = 128) or one row of block scales per
              output row (SCALE_ROWS = 1). BLOCK_K divides SCALE_K, so a tile lies in one K block:
              its dot is scaled by that block's scales before it joins the accumulator.
  INT4        W int32 `[K / 8, N]` (N contiguous; nibble j of word [r, n] is input 8r + j), `Scales`
              and `Zeros` `[G, N]` in x's dtype for groups of SCALE_K consecutive inputs (BLOCK_K
              divides SCALE_K, so a tile lies in one group). The words tile `[BLOCK_N, BLOCK_K / 8]`
              (loaded along N: 16-byte vectors) is dotted with x nibble position by nibble position
              (`_int4_nibble_dot`; tiles of fewer than 128 inputs are unpacked to codes, and so is a
              float32 x's tile, then converted). Int-to-float conversions run at a fraction of the ALU rate, so
              a code becomes a half by OR-ing it into the mantissa of MAGIC (the bits of OFFSET =
              1024.0 in fp16, 128.0 in bf16, whose mantissa steps by 1): `bits(MAGIC | code) =
              OFFSET + code` exactly, and `(OFFSET + code) - (OFFSET + zero)` is exact for the integer
              zeros 0..16 of AWQ / GPTQ (`qgemv.py` checks them at load).

With programmatic dependent launch (`rxf/core/runner/pdl.py`) a program reads its first weight tile
and that tile's scales (and zeros) before waiting for the kernel that writes x, as the dense GEMV does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl
from rxf.plugins.models.layers.gemv_kernel import BLOCK_M, ROWS, finish, program_span

FP8_ROWS, FP8_BLOCKS, INT4 = 0, 1, 2  # the weight formats (`fmt`)
# The same, as the kernel sees them (a global read inside a kernel must be a constexpr).
_FP8_ROWS, _FP8_BLOCKS, _INT4 = tl.constexpr(FP8_ROWS), tl.constexpr(FP8_BLOCKS), tl.constexpr(INT4)
# A half whose mantissa counts in units of 1: (its bits, its value), per x dtype.
_MAGIC = {torch.float16: (0x6400, 1024.0), torch.bfloat16: (0x4300, 128.0), torch.float32: (0, 0.0)}
# The row kernel's int4 code field and float32 128.0 (`qgemv_row_kernel._int4_fma`), passed as arguments.
_INT4_MASK, _INT4_MAGIC = 0x000F0000, 0x43000000
# The tile kernel's (`_int4_nibble_dot`): a code into each half of a word; its MAGIC is `_MAGIC`'s pair.
_PAIR_MASK = 0x000F000F
# The int4 row kernel with half-precision x: two codes an operation in x's dtype (`_int4_pairs_fma`,
# "1", the default) or one code an operation in float32 (`_int4_fma`, "0"); read at import. In fp16 its
# codes count in sixteenths (64.0's bits: OFFSET + code / 16), so no product exceeds |x|.
_F16_SIXTEENTHS = (0x5400, 64.0)
_PAIRS_ENV = os.environ.get("RXF_INT4_PAIRS", "1")
if _PAIRS_ENV not in ("0", "1"):
    raise ValueError(f"RXF_INT4_PAIRS={_PAIRS_ENV!r}: expected 1 (half2 arithmetic) or 0 (float32)")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32; IEEE keeps float32 inputs in full precision (tl.dot would use TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k0, cols, n_ok, stride_s,
                 FORMAT: tl.constexpr, SCALE_K: tl.constexpr, EVEN: tl.constexpr):
    """The weight tile at `w_ptrs` (K offset k0) as stored, with what dequantizes it: (tile, scale,
    zero), the int4 group's scales and zeros or the FP8 block's scales per row (row scales wait for
    the epilogue: scale and zero are then placeholders). Rows outside `n_ok` read zeros; EVEN: every
    row of the tile is in `n_ok` (its load is unmasked)."""
    if FORMAT == _INT4:
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        group = (k0 // SCALE_K) * stride_s
        scale = tl.load(Scales + group + cols, mask=n_ok, other=0.0)
        zero = tl.load(Zeros + group + cols, mask=n_ok, other=0.0)
    else:
        if EVEN:
            w = tl.load(w_ptrs)
        elif w_ptrs.dtype.element_ty == tl.int32:  # FP8 as int32 words of four (`tile_pointers`)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        if FORMAT == _FP8_BLOCKS:
            scale = tl.load(s_ptrs + k0 // SCALE_K, mask=n_ok, other=0.0)
        else:
            scale = tl.zeros_like(cols).to(tl.float32)
        zero = scale
    return w, scale, zero


@triton.jit
def _fp8_x(x_t):
    """x_t `[BLOCK_K, BLOCK_M]` (x's rows as columns) in E4M3, each column scaled by its largest
    magnitude over the tile / 448 (E4M3's largest value), and those float32 scales `[BLOCK_M]` (an
    all-zero column, a padding row, gets a tiny scale and stays zero)."""
    xf = x_t.to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-30) / 448.0
    return (xf / s[None, :]).to(tl.float8e4nv), s


@triton.jit
def _tile_dot(w, scale, zero, x_t, acc, MAGIC, FORMAT: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, OFFSET: tl.constexpr, XQ: tl.constexpr):
    """acc + dequant(w) @ x_t, for a tile `_weight_tile` read (FP8 row scales join in the epilogue).
    XQ (FP8 formats): x's tile is quantized to E4M3 (`_fp8_x`) and the dot runs FP8 x FP8 on the
    tensor cores, nothing converted per weight. One if/else chain with one return: Triton's compiler
    also generates the statements after a branch that returns (the interpreter does not), and an
    int4 tile there fails the shape check."""
    if XQ:
        xq, xs = _fp8_x(x_t)
        if FORMAT == _FP8_BLOCKS:
            out = acc + tl.dot(w, xq) * (scale[:, None] * xs[None, :])
        else:
            out = acc + tl.dot(w, xq) * xs[None, :]
    elif FORMAT == _INT4:  # float32 x, or tiles of fewer than 128 inputs (else `_int4_nibble_dot`)
        shifts = tl.arange(0, 8) * 4
        codes = tl.reshape((w[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        if IEEE:
            dq = codes.to(tl.float32) - zero[:, None]
        else:
            dq = (codes | (MAGIC & 0xFFFF)).to(tl.int16).to(x_t.dtype, bitcast=True) - (zero + OFFSET)[:, None]
        out = acc + _dot(dq, x_t, IEEE) * scale.to(tl.float32)[:, None]
    elif FORMAT == _FP8_BLOCKS:
        out = acc + _dot(w.to(x_t.dtype), x_t, IEEE) * scale[:, None]
    elif IEEE:
        out = tl.dot(w.to(x_t.dtype), x_t, acc, input_precision="ieee")
    else:
        out = tl.dot(w.to(x_t.dtype), x_t, acc)
    return out


@triton.jit
def tile_pointers(W, Scales, cols, k_lo, stride_w, stride_s, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALE_ROWS: tl.constexpr, WORDS: tl.constexpr):
    """(pointers of the weight tile at K offset k_lo, their step per tile, the FP8 block scales of the
    tile's rows). Int4 words are `[K / 8, N]`: the tile's rows are output columns, loaded along N.
    WORDS (FP8, the row kernel): the tile is read as int32 words of four consecutive inputs,
    `[BLOCK_N, BLOCK_K / 4]` (stride_w a multiple of 4)."""
    if FORMAT == _INT4:
        w_ptrs = W + (k_lo // 8 + tl.arange(0, BLOCK_K // 8)).to(tl.int64)[None, :] * stride_w + cols[:, None]
        w_step = (BLOCK_K // 8) * stride_w
    elif WORDS:
        words = W.to(tl.pointer_type(tl.int32))
        w_ptrs = words + cols.to(tl.int64)[:, None] * (stride_w // 4) + (k_lo // 4 + tl.arange(0, BLOCK_K // 4))[None, :]
        w_step = BLOCK_K // 4
    else:
        w_ptrs = W + cols.to(tl.int64)[:, None] * stride_w + (k_lo + tl.arange(0, BLOCK_K))[None, :]
        w_step = BLOCK_K
    return w_ptrs, w_step, Scales + (cols // SCALE_ROWS).to(tl.int64) * stride_s


@triton.jit
def first_tile(W, Scales, Zeros, N, K, stride_w, stride_s, FORMAT: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_K: tl.constexpr,
               PDL: tl.constexpr):
    """The tile kernel's start (the row kernel's is its own, for GATED's second tile): this program's
    span (`program_span`), its tile pointers, and its first weight tile with what dequantizes it, read
    before the PDL wait (weights and scales are fixed at load; the wait then lets the kernel read x).
    An empty K range (the last split may be) reads zeros, scales included (its group or block would
    lie past the tables' end).
    Returns (pid_n, pid_k, cols, mask_n, k_lo, k_hi, w_ptrs, w_step, s_ptrs, w, scale, zero)."""
    pid_n, pid_k, cols, mask_n, k_lo, k_hi = program_span(N, K, BLOCK_N, BLOCK_K, SPLIT_K)
    w_ptrs, w_step, s_ptrs = tile_pointers(W, Scales, cols, k_lo, stride_w, stride_s, FORMAT, BLOCK_K, SCALE_ROWS,
                                           False)
    # (vector compares: Triton's interpreter rejects a mask broadcast from a scalar)
    first_n = mask_n & (tl.zeros_like(cols) + k_lo < k_hi)
    w, scale, zero = _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k_lo, cols, first_n, stride_s, FORMAT, SCALE_K, False)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    return pid_n, pid_k, cols, mask_n, k_lo, k_hi, w_ptrs, w_step, s_ptrs, w, scale, zero


@triton.jit
def _int4_nibble_dot(w, scale, zero, x_ptrs, x_mask, acc_t, MASK, MAGIC, OFFSET: tl.constexpr):
    """acc_t `[BLOCK_M, BLOCK_N]` + x @ dequant(w).T for an int4 words tile w `[BLOCK_N, BLOCK_K / 8]`
    in one group, without unpacking it into a tile of codes (whose reshape, and its layout change into
    the dot's operand, go through shared memory): one `tl.dot` per nibble position j, over the words'
    own layout, against x's inputs 8r + j (`x_ptrs` `[BLOCK_M, BLOCK_K / 8]` point at inputs 8r).

    A shift and a LOP3 give two halves per word at once: `(w >> 4j) & MASK | MAGIC` (MASK 0x000F000F,
    MAGIC the pair of OFFSET's half bits) holds OFFSET + code_j in its low half and OFFSET + code_j+4
    in its high half, exactly. The dots take those as they are (float32 accumulation of exact
    products), and `(OFFSET + zero) * sum(x)` over the tile comes off once: the tile lies in one
    group. Static count (`benchmarks/sass_count.py --kernel int4-tile`, sm_90, 128 x 128, 4 warps):
    4.8-4.9 instructions a weight, against 7.6 for the unpacked tile; on an H100 (2026-12-05,
    benchmarks/RESULTS.md) Llama-3-8B's gate_up at 2 rows took 64 us, against 87 us unpacked the day
    before (another call)."""
    t = tl.zeros_like(acc_t)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in tl.static_range(4):
        pair = ((w >> (4 * j)) & MASK) | MAGIC
        x_lo = tl.load(x_ptrs + j, mask=x_mask, other=0.0)
        x_hi = tl.load(x_ptrs + j + 4, mask=x_mask, other=0.0)
        lo = pair.to(tl.int16).to(x_lo.dtype, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(x_lo.dtype, bitcast=True)
        t = tl.dot(x_lo, tl.trans(lo), t)
        t = tl.dot(x_hi, tl.trans(hi), t)
        x_sum += tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
    offset = zero.to(tl.float32) + OFFSET
    return acc_t + (t - x_sum[:, None] * offset[None, :]) * scale.to(tl.float32)[None, :]


@triton.jit
def _qgemv_kernel(
    X, W, Scales, Zeros, Bias, Out, Partials, Counters, M, N, K,
    stride_xm, stride_w, stride_s, stride_om, MASK, MAGIC,
    FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr, SCALE_ROWS: tl.constexpr,
    SCALE_K: tl.constexpr, OFFSET: tl.constexpr, PDL: tl.constexpr, XQ: tl.constexpr,
):
    # The first K tile is peeled off the loop, as in gemv_kernel (read before the PDL wait). Half-precision
    # x with int4 weights takes `_int4_nibble_dot` (its accumulator `[BLOCK_M, BLOCK_N]`) where a nibble
    # position's dot has the 16 inputs a tensor-core dot needs (BLOCK_K >= 128), the rest `_tile_dot`.
    NIBBLES: tl.constexpr = FORMAT == _INT4 and not IEEE and BLOCK_K >= 128
    pid_n, pid_k, cols, mask_n, k_lo, k_hi, w_ptrs, w_step, s_ptrs, w, scale, zero = first_tile(
        W, Scales, Zeros, N, K, stride_w, stride_s, FORMAT, BLOCK_N, BLOCK_K, SPLIT_K, SCALE_ROWS, SCALE_K, PDL)
    rows = tl.arange(0, BLOCK_M)  # rows of x
    x_mask = (rows < M)[:, None]
    first_mask = x_mask & (tl.zeros_like(rows) + k_lo < k_hi)[:, None]
    if NIBBLES:
        x_ptrs = X + rows[:, None] * stride_xm + (k_lo + 8 * tl.arange(0, BLOCK_K // 8))[None, :]
        acc = _int4_nibble_dot(w, scale, zero, x_ptrs, first_mask, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                               MASK, MAGIC, OFFSET)
    else:
        x_ptrs = X + rows[:, None] * stride_xm + (k_lo + tl.arange(0, BLOCK_K))[None, :]
        x_t = tl.trans(tl.load(x_ptrs, mask=first_mask, other=0.0))
        acc = _tile_dot(w, scale, zero, x_t, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), MAGIC, FORMAT, IEEE,
                        BLOCK_N, BLOCK_K, OFFSET, XQ)
    w_ptrs += w_step
    x_ptrs += BLOCK_K
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # K is a multiple of BLOCK_K (the wrapper checks)
        w, scale, zero = _weight_tile(w_ptrs, Scales, Zeros, s_ptrs, k0, cols, mask_n, stride_s, FORMAT, SCALE_K,
                                      EVEN_N)
        if NIBBLES:
            acc = _int4_nibble_dot(w, scale, zero, x_ptrs, x_mask, acc, MASK, MAGIC, OFFSET)
        else:
            x_t = tl.trans(tl.load(x_ptrs, mask=x_mask, other=0.0))
            acc = _tile_dot(w, scale, zero, x_t, acc, MAGIC, FORMAT, IEEE, BLOCK_N, BLOCK_K, OFFSET, XQ)
        w_ptrs += w_step
        x_ptrs += BLOCK_K
    if NIBBLES:
        acc = tl.trans(acc)
    finish(acc, acc, Bias, Out, Partials, Counters, Scales, cols, rows, mask_n, M, N, stride_om, pid_n, pid_k,
           BLOCK_N, SPLIT_K, False, HAS_BIAS, FORMAT == _FP8_ROWS)


def partials_for(out: torch.Tensor, n_blocks: int, split_k: int, block_n: int, tiles: int = 1) -> torch.Tensor:
    """The float32 scratch a launch's split-K hand-off (`finish`) writes: a `[block_n, ROWS]` tile per
    program (two, gated); without a split, `out` (the kernel never touches it)."""
    if split_k == 1:
        return out
    return torch.empty(n_blocks * split_k * tiles * block_n * ROWS, dtype=torch.float32, device=out.device)


def qgemv(
    x: torch.Tensor, fmt: int, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    bias: torch.Tensor | None, counters: torch.Tensor, *, scale_rows: int, scale_k: int,
    block_n: int, block_k: int, split_k: int, num_stages: int, num_warps: int, row: bool = False,
    fp8_x: bool = False, gated: bool = False,
) -> torch.Tensor:
    """`x @ dequant(weight).T + bias` in x's dtype for x `[m <= 16, K]` (contiguous rows), `weight`
    and `scales` (and int4's `zeros`) as `fmt`'s entry of the module docstring says. `counters`:
    int32, at least cdiv(N, block_n) zeros, left zeroed. row: one row of x goes through
    `qgemv_row_kernel` (num_stages >= 2: two weight tiles read ahead, else one). fp8_x (FP8 formats,
    the tile kernel): x is quantized to E4M3 per row and K tile, the product computed FP8 x FP8 (as the
    methods' GEMMs quantize x). gated (the row kernel, one row of x): the weight is `[gate | up]` and
    the result silu(gate) * up, `[1, N / 2]` (a program reads block_n / 2 rows of each)."""
    m, k = x.shape
    n = weight.shape[1] if fmt == INT4 else weight.shape[0]
    assert not (fp8_x and (fmt == INT4 or row or x.dtype == torch.float32)), "fp8_x: FP8 formats, half x, tile kernel"
    assert not gated or (row and m == 1), "gated: the row kernel, one row"
    assert m <= ROWS, f"{m} rows: the GEMV takes at most {ROWS}"
    assert k % block_k == 0 and scale_k % block_k == 0, (
        f"K {k} and the scale block {scale_k} must be multiples of block_k {block_k}")
    assert (weight.shape[0] * 8 if fmt == INT4 else weight.shape[1]) == k, f"weight {tuple(weight.shape)} for K {k}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and scales.stride(-1) == 1, "x, weight and scales need contiguous rows"
    n_out = n // 2 if gated else n
    if gated:  # block_n counts the rows a program reads, gate and up: the grid and a program's bytes stay
        block_n //= 2  # the plain kernel's (H100, AWQ at batch 1: 350.5 tok/s against 341.1 with whole tiles)
    n_blocks = triton.cdiv(n_out, block_n)
    assert counters.numel() >= n_blocks, f"{counters.numel()} counters for {n_blocks} column blocks"
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    partials = partials_for(out, n_blocks, split_k, block_n, tiles=2 if gated else 1)
    magic, offset = _MAGIC[x.dtype]
    pdl = use_pdl(x)
    if row and m == 1:
        from rxf.plugins.quantization.qgemv_row_kernel import _qgemv_row_kernel

        assert fmt == INT4 or (weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0), (
            "the row kernel reads FP8 rows as int32 words")
        # int4 with half-precision x: two codes an operation in x's dtype, x read as int32 words
        # (`_int4_pairs_fma`; fp16 codes in sixteenths: 64.0's bits, offset 64)
        pairs = fmt == INT4 and x.dtype != torch.float32 and x.data_ptr() % 4 == 0 and _PAIRS_ENV == "1"
        if pairs and x.dtype == torch.float16:
            magic, offset = _F16_SIXTEENTHS
        mask, magic_arg = (_PAIR_MASK, magic | magic << 16) if pairs else (_INT4_MASK, _INT4_MAGIC)
        _qgemv_row_kernel[(n_blocks, split_k)](
            x, weight, scales, zeros if zeros is not None else scales, bias if bias is not None else out, out,
            partials, counters, n_out, k, weight.stride(0), scales.stride(0) if scales.dim() == 2 else 0,
            out.stride(0), mask, magic_arg, FORMAT=fmt, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            SCALE_ROWS=scale_rows, SCALE_K=scale_k, PDL=pdl, ASM=x.is_cuda, PAIRS=pairs, OFFSET=offset,
            BF16=x.dtype == torch.bfloat16, AHEAD=2 if num_stages >= 2 else 1, GATED=gated, num_warps=num_warps,
            launch_pdl=pdl,
        )
        return out
    _qgemv_kernel[(n_blocks, split_k)](
        x, weight, scales, zeros if zeros is not None else scales, bias if bias is not None else out, out, partials,
        counters, m, n, k, x.stride(0), weight.stride(0), scales.stride(0) if scales.dim() == 2 else 0, out.stride(0),
        _PAIR_MASK, magic | magic << 16, FORMAT=fmt, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=bias is not None,
        EVEN_N=n % block_n == 0, IEEE=x.dtype == torch.float32, SCALE_ROWS=scale_rows, SCALE_K=scale_k,
        OFFSET=offset, PDL=pdl, XQ=fp8_x, num_stages=num_stages, num_warps=num_warps, launch_pdl=pdl,
    )
    return out
