"""Fused mixture-of-experts for the GPU: two Triton grouped GEMMs over (token, expert) pairs sorted by
expert, with no Python loop over experts and no host synchronisation (CUDA-graph capturable).

For x `[T, H]` and top-k routing (`topk_weights`, `topk_ids` `[T, k]`) there are P = T * k pairs;
pair p is token p // k's choice p % k. Weights as `FusedExperts` holds them: w13 `[E, 2I, H]` (rows
`[gate | up]`), w2 `[E, H, I]`.

1. `align_pairs` sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M, so
   that every block of BLOCK_M rows belongs to one expert: one Triton program for decode-sized batches
   (a dozen small torch ops would cost more than the GEMMs' weight reads there), a stable sort and
   torch ops for prefills (the one program walks the pairs in turn: at Qwen3-30B-A3B's 4,096-token
   layer it took 1.8 of the layer's 2.8 ms). Region map of `sorted_pairs`:
     [start[e], start[e] + count[e])    expert e's pairs, ascending pair id
     [start[e] + count[e], end[e])      padding, value P (end[e] - start[e] is count[e] rounded up)
     [total, capacity)                  unused, value P; blocks starting here exit at once
   `block_expert[b]` is the expert of rows [b * BLOCK_M, (b + 1) * BLOCK_M) (clamped to E - 1 past
   total). capacity = P + min(P, E) * (BLOCK_M - 1) >= total: at most min(P, E) experts have pairs,
   each padding at most BLOCK_M - 1 rows. The grid is sized by capacity, known on the host.
2. `_gate_up_kernel`: act[row] = act(x[token] @ gate_e^T + b_gate_e, x[token] @ up_e^T + b_up_e) for
   every row of the sorted order (padding rows read zeros for x; their results are dropped), float32
   accumulation, one rounding to x.dtype; act is `moe.GatedActivation` (SiLU·up, or gpt-oss's
   clamped form), the biases only where the experts have them.
3. `_down_kernel`: y[pair] = topk_weight[pair] * (act[row] @ down_e^T + b_down_e), float32, for the
   real rows.
4. The top-k sum `y.view(T, k, H).sum(1)`, in float32, cast to x.dtype: a fixed order of additions
   (no atomics), so results do not depend on scheduling.

Up to `fused_moe_decode.MAX_TOKENS` tokens without a caller's block sizes take `fused_moe_decode`'s
two GEMV-shaped launches instead (no alignment, the top-k sum fused), unless the experts are so large
that the pairs' expected twice-read weights cost more than that saves (`fused_moe_decode.serves`:
gpt-oss-20b's batches of 2-4 stay on the grouped kernels).

FP8 weights (`scales`: `moe.ExpertScales`) are weight-only in both paths: each weight tile is loaded
in FP8 (half the bytes), upcast to x.dtype in registers and multiplied by its scales in float32 —
per row once after the K loop, or per K tile for block scales (a tile never spans two scale
blocks). Weight-only rather than FP8 x FP8 `tl.dot` with per-token activation scales: decode is
bound by the weight reads, which this halves, and prefill keeps bf16's accuracy at bf16's tensor-core
rate (the FP8 dot would double that rate at large M, at the cost of an activation-quantization
launch and its error).

Block sizes: the caller's, else those tuned for this shape and GPU (`fused_moe_table`, written by
benchmarks/gpu_moe_tune.py), else `pick_config`'s heuristic.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rxf.plugins.models.layers import fused_moe_decode, fused_moe_table
from rxf.plugins.models.layers.moe import SILU, ExpertScales, GatedActivation, kernel_scale_args


@dataclass(frozen=True)
class BlockConfig:
    block_m: int  # rows of the sorted order per block: both kernels use the same alignment
    block_n: int  # gate_up: columns of the intermediate (for each of gate and up)
    block_k: int
    down_block_n: int = 0  # down: columns of the output (0: block_n)
    group_m: int = 1  # row blocks that walk the columns together (shared weight tiles stay in L2)
    num_warps: int = 4
    num_stages: int = 3


def pick_config(num_pairs: int, num_experts: int, itemsize: int = 2) -> BlockConfig:
    """Block shapes by the expected rows per expert. Few rows (decode): the GEMMs stream the
    experts' weights, so small row blocks and many column programs; many rows: larger tiles.
    float32 tiles are twice the bytes: two pipeline stages keep them within shared memory."""
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 32:  # down: narrow column blocks, else too few programs to stream w2
        cfg = BlockConfig(16, 64, 128, down_block_n=32, group_m=4, num_warps=4, num_stages=4)
    elif rows_per_expert <= 128:
        cfg = BlockConfig(64, 64, 64, group_m=4, num_warps=4, num_stages=4)
    else:
        cfg = BlockConfig(128, 64, 64, down_block_n=128, group_m=8, num_warps=8, num_stages=3)
    return cfg if itemsize <= 2 else dataclasses.replace(cfg, num_stages=2)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def tuned_config(num_tokens: int, w13: torch.Tensor, dtype: torch.dtype) -> BlockConfig | None:
    """The blocks `fused_moe_table` holds for these experts' shape on their device, if any."""
    num_experts, two_inter, hidden = w13.shape
    key = fused_moe_table.table_key(num_experts, two_inter // 2, hidden, dtype, _device_name(w13.device))
    blocks = fused_moe_table.lookup(key, num_tokens)
    return None if blocks is None else BlockConfig(**blocks)


# `align_pairs` sorts with torch ops from this many of the kernel's chunks of pairs (`_align_chunk`): the
# kernel's one program walks the pairs a chunk at a time, so its time grows with them. One Qwen3-30B-A3B
# layer on an H100 (benchmarks/RESULTS.md, 2026-12-07), us with the kernel / the sort: 256 tokens
# (64 chunks) 565.0 / 578.2, 512 (128) 685.7 / 601.8, 4,096 2,755 / 1,158, 16,384 10,098 / 3,383.
ALIGN_SORT_MIN_CHUNKS = 128


@triton.jit(do_not_specialize=["num_pairs", "capacity", "num_blocks"])
def _align_kernel(
    TopkIds, SortedPairs, BlockExpert, Total, num_pairs, capacity, num_blocks,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: count pairs per expert, lay out the padded runs, place each pair, and label the
    blocks (the module docstring's region map). Lanes of experts >= NUM_EXPERTS count nothing."""
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(TopkIds + start + lanes, mask=start + lanes < num_pairs, other=E_PAD)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(Total, tl.sum(padded, axis=0))
    for start in range(0, capacity, CHUNK):
        rows = start + lanes
        tl.store(SortedPairs + rows, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=rows < capacity)
    tl.debug_barrier()  # the padding stores above land before the pair stores below overwrite some
    next_row = ends - padded  # per expert: where its next pair goes
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        ids = tl.load(TopkIds + pairs, mask=pairs < num_pairs, other=E_PAD)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, axis=0) - hit  # pairs of the same expert earlier in this chunk
        dest = tl.sum(hit * (earlier + next_row[None, :]), axis=1)
        tl.store(SortedPairs + dest, pairs, mask=pairs < num_pairs)
        next_row += tl.sum(hit, axis=0)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + lanes
        # The expert of a block = how many runs end at or before its first row.
        before = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(BlockExpert + blocks, tl.minimum(before, NUM_EXPERTS - 1), mask=blocks < num_blocks)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(sorted_pairs int32 `[blocks * block_m]`, block_expert int32 `[blocks]`, total int32 `[1]`),
    laid out as the module docstring's region map says: one kernel launch, or from ALIGN_SORT_MIN_CHUNKS
    of its chunks of pairs on `_align_by_sort` (the same tensors)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    blocks = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)
    chunk = _align_chunk(num_experts)
    if num_pairs >= ALIGN_SORT_MIN_CHUNKS * chunk:
        return _align_by_sort(flat, num_experts, block_m, blocks)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    total = torch.empty(1, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](
        flat, sorted_pairs, block_expert, total, num_pairs, sorted_pairs.numel(), blocks,
        NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=chunk,
    )
    return sorted_pairs, block_expert, total


def _align_chunk(num_experts: int) -> int:
    """Pairs the align kernel takes per step: its [chunk, experts] comparison tile holds ~4096 values."""
    return max(16, 4096 // triton.next_power_of_2(num_experts))


def _align_by_sort(flat: torch.Tensor, num_experts: int, block_m: int, blocks: int) -> tuple[torch.Tensor, ...]:
    """`align_pairs`' tensors from a stable sort by expert and a dozen torch ops, every one parallel over
    the pairs (the kernel's single program walks them in turn); no host synchronisation."""
    ids = flat.to(torch.int64)
    num_pairs, dev = ids.numel(), ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)  # ascending pair id within each expert, as the kernel places them
    expert_of = ids[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[expert_of]
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    # A block's expert = how many runs end at or before its first row (the kernel's rule).
    firsts = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends, firsts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _tile(pid, num_blocks, n_size, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid`: GROUP_M row blocks sweep the columns together."""
    n_blocks = tl.cdiv(n_size, BLOCK_N)
    per_group = GROUP_M * n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _tile_dot(a, w, acc, s_ptrs, col_ok, IEEE: tl.constexpr, BLOCK_SCALED: tl.constexpr):
    """acc + a @ w, with w (FP8 or a's dtype) upcast to a's dtype in registers; BLOCK_SCALED: the
    product times its K block's weight scales (`s_ptrs`, one per column of w), as the scales
    change per block of inputs and cannot move out of the sum."""
    w = w.to(a.dtype)
    if BLOCK_SCALED:
        s = tl.load(s_ptrs, mask=col_ok, other=0.0)
        if IEEE:
            return acc + tl.dot(a, w, input_precision="ieee") * s[None, :]
        return acc + tl.dot(a, w) * s[None, :]
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_kernel(
    X, W13, B13, S13, Act, SortedPairs, BlockExpert, Total, num_pairs, num_blocks, N, K,
    stride_xt, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_at,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ALPHA: tl.constexpr, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr, UP_OFFSET: tl.constexpr,
    ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BK: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedPairs + rows)
    real = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + tokens[:, None] * stride_xt + ks[None, :]
    gate_ptrs = W13 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # FP8 weights: the scales of these columns (gate rows, then up rows N further), per K block or row.
    s_gate = S13 + expert * stride_se + cols.to(tl.int64) * stride_sn
    s_up = s_gate + N * stride_sn
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(x_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(gate_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_gate = _tile_dot(a, g, acc_gate, s_gate + k0 // SCALE_BK, col_ok, IEEE, BLOCK_SCALED)
        acc_up = _tile_dot(a, u, acc_up, s_up + k0 // SCALE_BK, col_ok, IEEE, BLOCK_SCALED)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if ROW_SCALED:
        acc_gate *= tl.load(s_gate, mask=col_ok, other=0.0)[None, :]
        acc_up *= tl.load(s_up, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:  # B13[e] is [gate | up], like W13[e]'s rows
        bias_ptrs = B13 + expert * stride_be + cols
        acc_gate += tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LIMIT:
        acc_gate = tl.minimum(acc_gate, LIMIT)
        acc_up = tl.minimum(tl.maximum(acc_up, -LIMIT), LIMIT)
    act = (acc_up + UP_OFFSET) * (acc_gate * tl.sigmoid(acc_gate * ALPHA))
    out_ptrs = Act + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(out_ptrs, act.to(Act.dtype.element_ty), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_kernel(
    Act, W2, B2, S2, Y, TopkWeights, SortedPairs, BlockExpert, Total, num_pairs, num_blocks, N, K,
    stride_at, stride_we, stride_wn, stride_be, stride_se, stride_sn, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BK: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedPairs + rows)
    real = pairs < num_pairs
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = Act + rows[:, None].to(tl.int64) * stride_at + ks[None, :]
    w_ptrs = W2 + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    s_ptrs = S2 + expert * stride_se + cols.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _tile_dot(a, w, acc, s_ptrs + k0 // SCALE_BK, col_ok, IEEE, BLOCK_SCALED)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if ROW_SCALED:
        acc *= tl.load(s_ptrs, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(B2 + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(TopkWeights + pairs, mask=real, other=0.0)[:, None]
    y_ptrs = Y + pairs[:, None].to(tl.int64) * stride_yp + cols[None, :]
    tl.store(y_ptrs, acc, mask=real[:, None] & col_ok[None, :])


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: BlockConfig | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: GatedActivation = SILU,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Same contract as `moe.experts_native`: `[T, H]` in x.dtype, the routing-weighted sum of each
    token's top-k experts. x, w13 and w2 share a dtype, or the weights are FP8 with their `scales`
    (weight-only: upcast in registers, activations in x.dtype); the weights' last dimension is
    contiguous; the biases are both given or neither."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_experts needs expert weights with a contiguous last dimension")
    if (b13 is None) != (b2 is None):
        raise ValueError("fused_experts takes both expert biases or neither")
    has_bias = b13 is not None
    if has_bias and (b13.stride(-1) != 1 or b2.stride(-1) != 1):
        raise ValueError("fused_experts needs expert biases with a contiguous last dimension")
    x = x.contiguous()
    if config is None and fused_moe_decode.serves(num_tokens, w13, w2, top_k):
        return fused_moe_decode.decode_experts(x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2,
                                               activation=activation, scales=scales)
    num_pairs = num_tokens * top_k
    cfg = config or tuned_config(num_tokens, w13, x.dtype) or pick_config(num_pairs, num_experts, x.element_size())
    scale_args, s13, s2 = kernel_scale_args(scales, cfg.block_k, w13, w2)
    cfg = dataclasses.replace(cfg, block_k=scale_args.pop("kernel_block_k"))
    sorted_pairs, block_expert, total = align_pairs(topk_ids, num_experts, cfg.block_m)
    num_blocks = block_expert.numel()
    act = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down_n = cfg.down_block_n or cfg.block_n
    common = {"BLOCK_M": cfg.block_m, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
              "IEEE": x.dtype == torch.float32, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    # Without biases the bias pointers are the weights (never read: HAS_BIAS prunes the loads).
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, cfg.block_n),)](
        x, w13, b13 if has_bias else w13, s13, act, sorted_pairs, block_expert, total, num_pairs, num_blocks,
        inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if has_bias else 0,
        s13.stride(0), s13.stride(1), act.stride(0), TOP_K=top_k, BLOCK_N=cfg.block_n, HAS_BIAS=has_bias,
        ALPHA=float(activation.alpha), HAS_LIMIT=activation.limit is not None,
        LIMIT=float(activation.limit or 0.0), UP_OFFSET=float(activation.up_offset), **common, **scale_args,
    )
    _down_kernel[(num_blocks * triton.cdiv(hidden, down_n),)](
        act, w2, b2 if has_bias else w2, s2, y, weights, sorted_pairs, block_expert, total, num_pairs, num_blocks,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if has_bias else 0,
        s2.stride(0), s2.stride(1), y.stride(0), BLOCK_N=down_n, HAS_BIAS=has_bias, **common, **scale_args,
    )
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
