"""Mixture-of-experts for decode batches of a few tokens: two GEMV-shaped Triton launches per layer
that index the experts' weights straight from the routing, with no sort, no padding to row blocks and
no separate top-k sum (the grouped kernels of `fused_moe` need an alignment launch before the two
GEMMs and a sum and a cast after them: three launches more, which at Qwen3-30B-A3B's batch-1 shapes
cost more than the weight reads themselves).

For T tokens with top-k routing there are P = T * k (token, expert) pairs, pair p = token p // k's
choice p % k (as in `fused_moe`). Weights as `FusedExperts` holds them: w13 `[E, 2I, H]` (rows
`[gate | up]`), w2 `[E, H, I]`.

1. `_gate_up_kernel`, grid (P, cdiv(I, BLOCK_N)): act[p, cols] = act(x[t] @ gate_e[cols]^T + b,
   x[t] @ up_e[cols]^T + b) for e = topk_ids[p], float32 accumulation, one rounding to x.dtype.
2. `_down_kernel`, grid (T * cdiv(H, BLOCK_N), k): program (b, j) computes pair j of its token:
   topk_weight * (act[p] @ down_e[cols]^T + b_down_e) in float32 and writes it to `partials`; the
   last of the k programs of a (token, column block) to arrive sums the k partials in the fixed order
   j = 0 .. k-1 (results do not depend on scheduling), writes y in x.dtype and resets its counter.
   The hand-off is `gemv_kernel`'s: partial stores, a CTA barrier, an acq_rel atomic on the
   counter, `.cg` loads of the partials by the last program.

Each kernel has two forms, chosen by the fifth element of its blocks (ROW):
- ROW (the default, faster on the H200 at 1, 2 and 4 tokens): the weight tiles are multiplied by the
  activation row element by element in float32 registers and summed over K once at the end, with no
  tl.dot and no shared memory, the next tile's loads issued before the current tile's math
  (`gemv_row_kernel.py`: without shared memory more programs fit on an SM, their loads in flight).
- tile: weight tiles stream through `tl.dot` against the activation row padded to a 16-column tile
  (as `gemv_kernel` does), so Triton's software pipeline keeps `num_stages` tiles in flight.
FP8 weights are upcast in registers and scaled as `fused_moe` describes (block scales shrink the
K tiles to the scale block when it is smaller).

With programmatic dependent launch (`rxf/core/runner/pdl.py`) the gate/up kernel waits first (every
weight it reads is picked by an expert id the routing kernel writes) and only then lets the down
kernel start, so that the down kernel may read its expert id (the routing kernel's, written and
visible by then; read past L1) and, in the ROW form, its first weight tile before its own wait, for
act: its weights stream while the gate/up kernel runs. On an H100 that took Qwen3-30B-A3B's batch 1
from 277.1 to 285.7 tok/s (benchmarks/RESULTS.md, 2026-12-06).

Counters: one int32 buffer per device (`launch_counters`), shared by every layer and by the fused
router (`routing_kernel.route_cuda`). Invariant between launches: all zero (each launch resets the
counters it used). The layers of a forward run one after another on one stream, so no two launches
use the buffer at once. It is allocated on the first call, eagerly (the CUDA-graph runner warms every
batch size up before capturing it), and kept.
"""

from __future__ import annotations

import functools
import os
import re

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl
from rxf.plugins.models.layers.moe import SILU, ExpertScales, GatedActivation, kernel_scale_args

MAX_TOKENS = 4  # the most tokens routed here; more share experts, which the grouped kernels read once
# These kernels read one expert per (token, expert) pair; the grouped kernels read each distinct expert
# once but add an alignment launch, a top-k sum and programs for every expert's (mostly empty) row
# blocks, a cost that grows with the experts. Up to MAX_TOKENS tokens come here while the weight bytes
# their pairs are expected to read twice (uniform routing) stay within this many per expert: fitted
# to batches of 2-4 on an H100 (benchmarks/RESULTS.md, 2026-12-07; decode tok/s, these / grouped):
# gpt-oss-20b (32 experts of 47.5 MiB, top 4: 24-131 MiB read twice, bound 16) 412.9 / 420.6,
# 400.6 / 424.5, 533.1 / 567.0: grouped; Qwen3-30B-A3B (128 of 9.0 MiB, top 8: 4-26 MiB, bound 64)
# 459.5 / 405.8, 471.4 / 444.9, 614.7 / 576.5: these. Other shapes follow it unmeasured (Mixtral's
# 8 experts of 336 MiB: grouped from 2 tokens). One token reads no expert twice: always here.
DUPLICATE_BYTES_PER_EXPERT = 512 * 1024
ROWS = tl.constexpr(16)  # columns of the padded activation tile: tl.dot's smallest

Blocks = tuple[int, int, int, int, bool]  # (block_n, block_k, num_warps, num_stages, ROW) of one kernel
# The ROW form at both: on the H200 at Qwen3-30B-A3B's shapes (benchmarks/gpu_moe_decode.py, 2026-12-05)
# 23.2 us a 1-token layer against 28.8 for the tile form's (16, 256, 4, 4) and (32, 256, 4, 4), and
# 41.5 / 74.8 against 48.5 / 86.0 at 2 / 4 tokens; a batch-1 decode step 273.6 -> 294.7 tok/s.
GATE_UP_BLOCKS: Blocks = (16, 256, 4, 1, True)
DOWN_BLOCKS: Blocks = (32, 128, 8, 1, True)
# Shapes whose sweep (`benchmarks/gpu_moe_decode.py --shape ...`) favoured other blocks, by (experts,
# expert width on this rank, hidden), as `label`s: gpt-oss-20b on an H100 (2026-12-07): the down kernel
# at (32, 256, 4 warps) 70.4 us a 1-token layer against the defaults' 72.2, batch-1 decode 298.5 ->
# 307.6 tok/s (its batches of 2-4 take the grouped kernels, `serves`).
SHAPE_BLOCKS: dict[tuple[int, int, int], tuple[str, str]] = {
    (32, 2880, 2880): ("n16k256w4st1r", "n32k256w4st1r"),
}
# `RXF_MOE_DECODE="GATE_UP,DOWN"` (read once per process) replaces both for every shape, each as `label`
# writes it, e.g. "n16k256w4st4,n32k256w4st4" (the tile form; a trailing r: the ROW form);
# `benchmarks/gpu_moe_decode.py` prints the value its sweep favours.
ENV = "RXF_MOE_DECODE"
_LABEL = re.compile(r"n(\d+)k(\d+)w(\d+)st(\d+)(r?)")


def serves(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    """Whether `fused_moe.fused_experts` takes these kernels for `num_tokens` tokens (without a
    caller's blocks): up to MAX_TOKENS, while the expected twice-read bytes stay within
    DUPLICATE_BYTES_PER_EXPERT per expert (the shapes are this rank's, the bytes its weights' dtype)."""
    if num_tokens > MAX_TOKENS:
        return False
    num_experts = w13.shape[0]
    distinct = num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)  # expected, uniform routing
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return (num_tokens * top_k - distinct) * expert_bytes <= num_experts * DUPLICATE_BYTES_PER_EXPERT


def label(blocks: Blocks) -> str:
    bn, bk, warps, stages, row = blocks
    return f"n{bn}k{bk}w{warps}st{stages}{'r' if row else ''}"


def _parse(labels: list[str], where: str) -> tuple[Blocks, Blocks]:
    parts = [_LABEL.fullmatch(part.strip()) for part in labels]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{where}: expected GATE_UP,DOWN labels like n16k256w4st4,n16k512w8st1r")
    return tuple((int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5] == "r") for m in parts)  # type: ignore[return-value]


@functools.cache
def default_blocks(shape: tuple[int, int, int] | None = None) -> tuple[Blocks, Blocks]:
    """(gate/up, down) blocks for experts of `shape` (experts, expert width, hidden): `RXF_MOE_DECODE`'s,
    else SHAPE_BLOCKS' for the shape, else GATE_UP_BLOCKS and DOWN_BLOCKS."""
    value = os.environ.get(ENV, "")
    if value:
        return _parse(value.split(","), f"{ENV}={value!r}")
    if shape in SHAPE_BLOCKS:
        return _parse(list(SHAPE_BLOCKS[shape]), f"SHAPE_BLOCKS[{shape}]")
    return GATE_UP_BLOCKS, DOWN_BLOCKS

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def launch_counters(device: torch.device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@triton.jit
def _row_dot(W, offsets, x_t, n_ok, k_ok, acc, s_ptrs, IEEE: tl.constexpr, BLOCK_SCALED: tl.constexpr):
    """acc + the W tile at `offsets` (masked by n_ok x k_ok; FP8 or x_t's dtype, upcast in registers)
    @ the padded activation tile x_t; BLOCK_SCALED: the product times its K block's weight scales
    (`s_ptrs`, one per row of the tile)."""
    w = tl.load(W + offsets, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(x_t.dtype)
    if BLOCK_SCALED:
        s = tl.load(s_ptrs, mask=n_ok, other=0.0)
        if IEEE:
            return acc + tl.dot(w, x_t, input_precision="ieee") * s[:, None]
        return acc + tl.dot(w, x_t) * s[:, None]
    if IEEE:
        return tl.dot(w, x_t, acc, input_precision="ieee")
    return tl.dot(w, x_t, acc)


@triton.jit
def _first_column(acc):
    """The [BLOCK_N] column 0 of an accumulator tile: the real activation row's results."""
    cols = tl.arange(0, ROWS)
    return tl.sum(tl.where((cols == 0)[None, :], acc, 0.0), axis=1)


@triton.jit
def _row_first(W, a_rows, b_rows, K, n_ok, TWO: tl.constexpr, BLOCK_K: tl.constexpr):
    """ROW: the first K tile of the weight rows at offsets `a_rows` (and `b_rows` when TWO), for
    `_row_stream`; apart so that a kernel can read it before its PDL wait."""
    ks = tl.arange(0, BLOCK_K)
    wa = tl.load(W + a_rows + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
    wb = wa
    if TWO:
        wb = tl.load(W + b_rows + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
    return wa, wb


@triton.jit
def _row_stream(W, a_rows, b_rows, wa, wb, x_row, K, n_ok, s_a, s_b, TWO: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BK: tl.constexpr):
    """ROW: ([BLOCK_N] float32 dots of the weight rows at offsets `a_rows` (and `b_rows` when TWO) with
    the activation row at `x_row`, over K, from their first tiles `wa`, `wb` (`_row_first`'s);
    BLOCK_SCALED: each K tile's products times its scale block's scales (`s_a`, `s_b`: the rows'
    first scales)."""
    ks = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # Pointers advance by BLOCK_K per tile (not rebuilt from k0): their alignment stays visible to Triton.
    a_ptrs = W + a_rows + ks[None, :]
    b_ptrs = W + b_rows + ks[None, :]
    for k0 in range(0, K, BLOCK_K):
        ahead = n_ok[:, None] & (k0 + BLOCK_K + ks < K)[None, :]
        a_ptrs += BLOCK_K
        wa_next = tl.load(a_ptrs, mask=ahead, other=0.0)  # issued before the math
        wb_next = wa_next
        if TWO:
            b_ptrs += BLOCK_K
            wb_next = tl.load(b_ptrs, mask=ahead, other=0.0)
        x = tl.load(x_row + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)[None, :]
        if BLOCK_SCALED:
            acc_a += wa.to(tl.float32) * x * tl.load(s_a + k0 // SCALE_BK, mask=n_ok, other=0.0)[:, None]
            if TWO:
                acc_b += wb.to(tl.float32) * x * tl.load(s_b + k0 // SCALE_BK, mask=n_ok, other=0.0)[:, None]
        else:
            acc_a += wa.to(tl.float32) * x
            if TWO:
                acc_b += wb.to(tl.float32) * x
        wa, wb = wa_next, wb_next
    return tl.sum(acc_a, axis=1), tl.sum(acc_b, axis=1)


@triton.jit
def _gate_up_kernel(
    X, W13, B13, S13, Act, TopkIds, N, K,
    stride_xt, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_ap,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr, ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr, ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BK: tl.constexpr,
    PDL: tl.constexpr, ROW: tl.constexpr,
):
    if PDL:  # the routing kernel writes the expert ids that pick every weight read (rxf/core/runner/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # after the wait: the down kernel reads the ids before its own
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(TopkIds + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, ROWS)
    gate_rows = expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    up_rows = gate_rows + N * stride_wn
    # FP8 weights: the scales of these rows (gate, then up N rows further), per K block or row.
    s_gate = S13 + expert * stride_se + cols.to(tl.int64) * stride_sn
    s_up = s_gate + N * stride_sn
    if ROW:
        rows = expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        wa, wb = _row_first(W13, rows, rows + N * stride_wn, K, col_ok, True, BLOCK_K)
        gate, up = _row_stream(W13, rows, rows + N * stride_wn, wa, wb, X + token * stride_xt, K, col_ok, s_gate, s_up,
                               True, BLOCK_N, BLOCK_K, BLOCK_SCALED, SCALE_BK)
    else:
        acc_gate = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            # [BLOCK_K, ROWS]: x's row in column 0, zeros elsewhere
            x_t = tl.load(X + token * stride_xt + k0 + ks[:, None] + lanes[None, :] * 0,
                          mask=k_ok[:, None] & (lanes == 0)[None, :], other=0.0)
            acc_gate = _row_dot(W13, gate_rows + k0, x_t, col_ok, k_ok, acc_gate, s_gate + k0 // SCALE_BK, IEEE,
                                BLOCK_SCALED)
            acc_up = _row_dot(W13, up_rows + k0, x_t, col_ok, k_ok, acc_up, s_up + k0 // SCALE_BK, IEEE,
                              BLOCK_SCALED)
        gate = _first_column(acc_gate)
        up = _first_column(acc_up)
    if ROW_SCALED:
        gate *= tl.load(s_gate, mask=col_ok, other=0.0)
        up *= tl.load(s_up, mask=col_ok, other=0.0)
    if HAS_BIAS:  # B13[e] is [gate | up], like W13[e]'s rows
        bias = B13 + expert * stride_be + cols
        gate += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(bias + N, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    act = (up + UP_OFFSET) * (gate * tl.sigmoid(gate * ALPHA))
    tl.store(Act + pair.to(tl.int64) * stride_ap + cols, act.to(Act.dtype.element_ty), mask=col_ok)


@triton.jit
def _down_kernel(
    Act, W2, B2, S2, Y, TopkWeights, TopkIds, Partials, Counters, N, K,
    stride_ap, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_yt,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr, ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BK: tl.constexpr,
    PDL: tl.constexpr, ROW: tl.constexpr,
):
    """Under PDL the gate/up kernel before this one let it start only after its own wait, so the
    routing kernel's expert ids are written and visible (read past L1): the id and, in the ROW form,
    the first weight tile are read before the wait, which act needs (see the module docstring)."""
    block = tl.program_id(0)  # token * n_blocks + column block
    j = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    token = block // n_blocks
    pair = token * TOP_K + j
    cols = (block % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    expert = tl.load(TopkIds + pair, cache_modifier=".cg").to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, ROWS)
    w_rows = expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    s_ptrs = S2 + expert * stride_se + cols.to(tl.int64) * stride_sn
    if ROW:
        rows = expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        wa, _ = _row_first(W2, rows, rows, K, col_ok, False, BLOCK_K)
    if PDL:  # act is the gate/up kernel's
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if ROW:
        part, _ = _row_stream(W2, rows, rows, wa, wa, Act + pair.to(tl.int64) * stride_ap, K, col_ok, s_ptrs, s_ptrs,
                              False, BLOCK_N, BLOCK_K, BLOCK_SCALED, SCALE_BK)
    else:
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a_t = tl.load(Act + pair.to(tl.int64) * stride_ap + k0 + ks[:, None] + lanes[None, :] * 0,
                          mask=k_ok[:, None] & (lanes == 0)[None, :], other=0.0)
            acc = _row_dot(W2, w_rows + k0, a_t, col_ok, k_ok, acc, s_ptrs + k0 // SCALE_BK, IEEE, BLOCK_SCALED)
        part = _first_column(acc)
    if ROW_SCALED:
        part *= tl.load(s_ptrs, mask=col_ok, other=0.0)
    if HAS_BIAS:
        part += tl.load(B2 + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
    part *= tl.load(TopkWeights + pair)
    y_ptrs = Y + token.to(tl.int64) * stride_yt + cols
    if TOP_K == 1:
        tl.store(y_ptrs, part.to(Y.dtype.element_ty), mask=col_ok)
    else:
        lane = tl.arange(0, BLOCK_N)
        first = Partials + block.to(tl.int64) * (TOP_K * BLOCK_N)
        tl.store(first + j * BLOCK_N + lane, part)
        tl.debug_barrier()  # every thread's partial stores precede the counter update
        arrived = tl.atomic_add(Counters + block, 1, sem="acq_rel")
        if arrived == TOP_K - 1:  # the last of this block's pairs sums them, in pair order
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for i in tl.static_range(TOP_K):
                total += tl.load(first + i * BLOCK_N + lane, cache_modifier=".cg")
            tl.store(Counters + block, 0)
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=col_ok)


def decode_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: GatedActivation = SILU,
    scales: ExpertScales | None = None,
    blocks: tuple[Blocks, Blocks] | None = None,
) -> torch.Tensor:
    """`fused_moe.fused_experts`' contract for 1 .. MAX_TOKENS tokens (its checks already made:
    contiguous last dimensions, both biases or neither); `blocks`: the gate/up and down kernels'
    (default `default_blocks` for their shape; `benchmarks/gpu_moe_decode.py` sweeps them)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    blocks = blocks or default_blocks((num_experts, inter, hidden))
    assert 0 < num_tokens <= MAX_TOKENS, f"{num_tokens} tokens: the decode kernels take 1 .. {MAX_TOKENS}"
    has_bias = b13 is not None
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    pdl = use_pdl(x)
    bn, bk, warps, stages, row = blocks[0]
    scale_args, s13, s2 = kernel_scale_args(scales, bk, w13, w2)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, bn))](
        x, w13, b13 if has_bias else w13, s13, act, ids, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if has_bias else 0, s13.stride(0), s13.stride(1),
        act.stride(0), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=scale_args.pop("kernel_block_k"), IEEE=ieee,
        HAS_BIAS=has_bias, ALPHA=float(activation.alpha), HAS_LIMIT=activation.limit is not None,
        LIMIT=float(activation.limit or 0.0), UP_OFFSET=float(activation.up_offset), PDL=pdl, ROW=row,
        num_warps=warps, num_stages=stages, launch_pdl=pdl, **scale_args,
    )
    bn, bk, warps, stages, row = blocks[1]
    scale_args, s13, s2 = kernel_scale_args(scales, bk, w13, w2)
    blocks = num_tokens * triton.cdiv(hidden, bn)
    partials = torch.empty(blocks * top_k * bn, dtype=torch.float32, device=x.device) if top_k > 1 else y
    _down_kernel[(blocks, top_k)](
        act, w2, b2 if has_bias else w2, s2, y, weights, ids, partials, launch_counters(x.device, blocks), hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if has_bias else 0, s2.stride(0), s2.stride(1),
        y.stride(0), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=scale_args.pop("kernel_block_k"), IEEE=ieee,
        HAS_BIAS=has_bias, PDL=pdl, ROW=row, num_warps=warps, num_stages=stages, launch_pdl=pdl, **scale_args,
    )
    return y
