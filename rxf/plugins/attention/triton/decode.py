"""Decode attention over the page-size-1 KV pool, split over the KV length, in one Triton launch.

Request b's keys [lo, seq_len[b]) fall into num_kv_splits[b] equal chunks (see `_split_range`;
trailing chunks may be empty). A program computes, per (request, group of query heads, chunk), the
chunk's softmax-normalised weighted sum of V and its log-sum-exp; the chunks of a request are then
merged by their log-sum-exps by the last of its programs to finish. Splitting buys parallelism for
long contexts at small batch; the backend picks the counts.

Grid: (batch_size, num_kv_heads * head_blocks, grid_splits); program (b, g, s), with
kv_head = g // head_blocks and hb = g % head_blocks, handles the query heads
kv_head * GROUP + [hb * BLOCK_H, (hb + 1) * BLOCK_H) (clipped to the group), so each K/V element of its
chunk is loaded once for all the heads sharing it (head_blocks is 1 unless GROUP > 64).
Region map (row = b, or q_rows[b] for the one-token rows of an extend batch):
  reads  q[row, those heads, :]; slots req_to_token[row_b, start:end] and pool K/V there, kv head kv_head
  writes mid_o[b, those heads, s, :] and mid_lse[b, those heads, s] (only if start < end and the
         request has several non-empty chunks); out[row, those heads, :] (one program per (b, g))
Neither reads a slot at or past seq_len[b]. A request with seq_len 0 (e.g. a padded CUDA-graph entry)
has no non-empty chunk: its split-0 programs write zeros.

The merge (the hand-off of `gemv_kernel`): with one non-empty chunk its program merges in registers
and writes out. With n > 1, each of the n programs writes its chunk to mid_o / mid_lse, a CTA barrier
orders those stores before an acq_rel atomic increment of counters[b * G + g] (G = the grid's second
dimension), and the program that sees n - 1 (the last to arrive) resets the counter, reads the n chunks
(`.cg` loads, from L2) and merges them (results do not depend on which program finishes last): all at
once as one [heads, chunks, head_dim] tile (`_merge_tile`) where the tile fits `MERGE_TILE_LIMIT`, else
one after another in chunk order. Invariant between launches: every counter is 0.

lo is 0 without a sliding window. With window W, lo = max(seq_len - W, 0) (the new token at position
seq_len - 1 sees keys seq_len - W .. seq_len - 1) and the request uses only
min(num_kv_splits[b], cdiv(seq_len - lo, min_split_len)) chunks, the backend's split policy applied to
the W keys it reads (`_kv_range`): splits wholly before the window do not exist rather than being
masked, so a window of 128 costs 128 keys at any context. A soft-cap acts on the scores; the sink
enters once, in the merge, as a first "chunk" of log-sum-exp sink and zero value.

An FP8 pool's K/V are upcast in registers and scaled as in extend.py (`kv_scales`): k_scale folds
into the score scale and v_scale into each chunk's normalised output, so the merge sees values
already scaled. With half-precision q they are upcast to fp16 (one `cvt` per pair; to bf16 Triton
goes through float32, quarter-rate conversions), so q is scaled by the score scale and rounded to
fp16 first: 5.6 -> 4.0 instructions a K/V element in the loop's SASS for sm_90 (d128, 4 warps;
not yet timed). |q * scale| must stay below fp16's 65504, i.e. |q| below ~5e5 at head_dim 128.

LSEs are in base 2 (scores carry the log2(e) factor, as in extend.py); accumulation is fp32.

STORE (`DecodeStore`, the backend's `RXF_DECODE_STORE=fused`): the launch also does store_kv.py's work
for its batch, one launch a layer fewer. The program whose chunk holds its request's new token (the
last non-empty chunk; split 0 when seq_len is 0) writes that token's k (rotated, head-normalised) and
v to the pool at loc[b], then a CTA barrier orders those stores before its own reads of the slot
(other chunks never read it; the head blocks of that chunk each store the same bytes). Every program
rotates its query heads itself from the unrotated q. A row stores only its own token: rows that attend
over one another's new tokens (a speculative verify) need the separate store.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rxf.core.attention import HeadNorm
from rxf.core.kv_pool import is_fp8
from rxf.core.runner.pdl import use_pdl
from rxf.plugins.attention.triton.extend import (
    attend_pool,
    feature_args,
    kv_scale_args,
    kv_scales,
    pool_slots,
)
from rxf.plugins.attention.triton.store_kv import _head_normed, _to_pool, pool_scales

_M_INIT = -1.0e30  # finite running-max start: fully masked steps give weights 0, never NaN


@triton.jit
def _kv_range(seq_len, num_splits, window, min_split_len, HAS_WINDOW: tl.constexpr):
    """(lo, chunks): the request reads keys [lo, seq_len) in `chunks` chunks (see the module docstring)."""
    lo = seq_len * 0
    chunks = num_splits
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
        chunks = tl.minimum(num_splits, tl.maximum(tl.cdiv(seq_len - lo, min_split_len), 1))
    return lo, chunks


@triton.jit
def _split_len(lo, seq_len, num_splits):
    """Every chunk of a request has this length (the last may be shorter); at least 1, so that
    cdiv(seq_len - lo, split_len) counts the non-empty chunks even when seq_len is 0."""
    return tl.maximum(tl.cdiv(seq_len - lo, num_splits), 1)


@triton.jit
def _split_range(lo, seq_len, num_splits, split):
    """Chunk `split` of a request is [start, end). Chunks [0, cdiv(seq_len - lo, split_len)) are
    non-empty; later ones (uneven division, or split >= num_splits) have start >= end. Both stages
    derive the chunks from `_kv_range` and `_split_len`, so they agree on which exist."""
    split_len = _split_len(lo, seq_len, num_splits)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end


@triton.jit
def _merge(m_i, l_i, acc, lse, o):
    """Running log-sum-exp merge of one more chunk (lse [BLOCK_H], o [BLOCK_H, BLOCK_D], base 2)."""
    m_new = tl.maximum(m_i, lse)
    alpha = tl.exp2(m_i - m_new)
    w = tl.exp2(lse - m_new)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + w[:, None] * o


@triton.jit
def _merge_tile(MidO, MidLse, Out, Sinks, req, row, kv_head, head_block, non_empty, stride_mob, stride_moh, stride_mos,
                stride_mlb, stride_mlh, stride_ob, stride_oh, offs_d, mask_d, GROUP: tl.constexpr,
                BLOCK_H: tl.constexpr, MERGE_H: tl.constexpr, MERGE_S: tl.constexpr, M_INIT: tl.constexpr,
                HAS_SINKS: tl.constexpr):
    """The merge of a request's `non_empty` chunks (<= MERGE_S) for this program's query heads, all chunks
    loaded at once ([MERGE_H, MERGE_S, BLOCK_D], one L2 round trip rather than one a chunk): the same
    log-sum-exp weighting as `_merge` folded chunk by chunk. MERGE_H covers the program's real heads
    (min(GROUP, BLOCK_H) rounded up), not BLOCK_H's padding rows."""
    in_group = head_block * BLOCK_H + tl.arange(0, MERGE_H)
    mask_h = in_group < GROUP  # (MERGE_H <= BLOCK_H: no row of another head block)
    heads = kv_head * GROUP + in_group
    offs_s = tl.arange(0, MERGE_S)
    mask_hs = mask_h[:, None] & (offs_s < non_empty)[None, :]
    lse = tl.load(MidLse + req * stride_mlb + heads[:, None] * stride_mlh + offs_s[None, :], mask=mask_hs,
                  other=M_INIT, cache_modifier=".cg")
    o = tl.load(MidO + req * stride_mob + heads[:, None, None] * stride_moh + offs_s[None, :, None] * stride_mos
                + offs_d[None, None, :], mask=mask_hs[:, :, None] & mask_d[None, None, :], other=0.0,
                cache_modifier=".cg")
    m = tl.max(lse, axis=1)
    if HAS_SINKS:  # the sink as a chunk of log-sum-exp sink (base 2) and value zero
        sink = tl.load(Sinks + heads, mask=mask_h, other=0.0) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m[:, None])  # 0 for the masked chunks (M_INIT)
    l_sum = tl.sum(w, axis=1)
    if HAS_SINKS:
        l_sum += tl.exp2(sink - m)
    acc = tl.sum(w[:, :, None] * o, axis=1)
    out_ptrs = Out + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, (acc / l_sum[:, None]).to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _rope_normed(x, xp, first, cos, sin, inv, w, wp, dtype, HEAD_NORM: tl.constexpr):
    """Head vectors x (float32, [..., BLOCK_D]) rotated (NeoX rotate-half) given xp, each lane's partner
    in the other half, and `first` (the lanes of the first half), head-normalised first (HEAD_NORM,
    `inv` its rsqrt of the mean square, w / wp the weights at the lanes and the partners): the
    expressions and roundings of `store_kv._store_kv_kernel`, so both write the same bits."""
    if HEAD_NORM:
        x = _head_normed(x, inv, w, dtype)
        xp = _head_normed(xp, inv, wp, dtype)
    return tl.where(first, x * cos - xp * sin, x * cos + xp * sin)


@triton.jit
def _store_new_kv(KNew, VNew, KBuf, VBuf, slot, cos, sin, kw, kwp, KScale, VScale, req, kv_head, norm_eps,
                  stride_kn, stride_kh, stride_vn, stride_vh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                  offs_d, partner, first, mask_d, HEAD_DIM: tl.constexpr,
                  ROTATE: tl.constexpr, HEAD_NORM: tl.constexpr, KV_FP8: tl.constexpr, FMAX: tl.constexpr):
    """Request `req`'s new k (rotated by its position's `cos` / `sin` lanes, ROTATE; head-normalised
    first by the weights `kw` / `kwp` at the lanes and their partners, HEAD_NORM) and v for `kv_head`
    into the pool at `slot`, as `store_kv.rope_store_kv` would store them. k, its partner lanes and v
    are all loaded before the first store, so their reads overlap."""
    k_scale, v_scale = pool_scales(KScale, VScale, KV_FP8)
    k_row = KNew + req * stride_kn + kv_head * stride_kh
    k = tl.load(k_row + offs_d, mask=mask_d, other=0.0)
    kp = k
    if ROTATE:
        kp = tl.load(k_row + partner, mask=mask_d, other=0.0)
    v = tl.load(VNew + req * stride_vn + kv_head * stride_vh + offs_d, mask=mask_d, other=0.0)
    if ROTATE:
        kf = k.to(tl.float32)
        inv = 1.0
        if HEAD_NORM:
            inv = tl.math.rsqrt(tl.sum(kf * kf, axis=0) / HEAD_DIM + norm_eps)
        k = _rope_normed(kf, kp.to(tl.float32), first, cos, sin, inv, kw, kwp, KNew.dtype.element_ty, HEAD_NORM)
    tl.store(KBuf + slot * stride_kbs + kv_head * stride_kbh + offs_d,
             _to_pool(k, k_scale, KBuf.dtype.element_ty, FMAX, KV_FP8), mask=mask_d)
    tl.store(VBuf + slot * stride_vbs + kv_head * stride_vbh + offs_d,
             _to_pool(v, v_scale, VBuf.dtype.element_ty, FMAX, KV_FP8), mask=mask_d)


@triton.jit
def _decode_kernel(
    Q, KBuf, VBuf, ReqToToken, req_pool_indices, seq_lens, num_kv_splits, MidO, MidLse, Counters, Out, QRows,
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    qk_scale, cap_log2, window, min_split_len, KScale, VScale, Sinks,
    KNew, VNew, Loc, Positions, CosSin, QNormW, KNormW, norm_eps, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cs,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, M_INIT: tl.constexpr,
    IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_Q_ROWS: tl.constexpr, PDL: tl.constexpr,
    STORE: tl.constexpr, ROTATE: tl.constexpr, HEAD_NORM: tl.constexpr, FMAX: tl.constexpr,
    MERGE_H: tl.constexpr, MERGE_S: tl.constexpr,
):
    req = tl.program_id(0)
    if HAS_Q_ROWS:  # the decode rows of an extend batch: the request's row in q and out
        row = tl.load(QRows + req).to(tl.int64)
    else:
        row = req
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    lo, chunks = _kv_range(seq_len, tl.load(num_kv_splits + req), window, min_split_len, HAS_WINDOW)
    start, end = _split_range(lo, seq_len, chunks, split)
    non_empty = tl.cdiv(seq_len - lo, _split_len(lo, seq_len, chunks))

    in_group = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP  # BLOCK_H is at least 16 (tl.dot's minimum), so rows may be padding
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_hd = mask_h[:, None] & mask_d[None, :]
    out_ptrs = Out + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    half = HEAD_DIM // 2
    partner = (offs_d + half) % HEAD_DIM  # the lane a rotation pairs with each lane
    first = offs_d < half
    offs_n = tl.arange(0, BLOCK_N)
    row_base = ReqToToken + tl.load(req_pool_indices + req).to(tl.int64) * stride_r2t
    slots = pool_slots(row_base, start, end, offs_n)
    cos = tl.zeros([BLOCK_D], tl.float32)
    sin = cos
    qw = cos
    qwp = cos
    kw = cos
    kwp = cos
    if ROTATE:  # the request's position's angles, for its new k and its query heads
        pos = tl.load(Positions + req).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + offs_d % half, mask=mask_d, other=0.0)
        sin = tl.load(CosSin + pos * stride_cs + half + offs_d % half, mask=mask_d, other=0.0)
        if HEAD_NORM:  # the layer's head-norm weights at each lane and at its partner
            qw = tl.load(QNormW + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            qwp = tl.load(QNormW + partner, mask=mask_d, other=0.0).to(tl.float32)
            kw = tl.load(KNormW + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            kwp = tl.load(KNormW + partner, mask=mask_d, other=0.0).to(tl.float32)
    slot = 0
    if STORE:
        slot = tl.load(Loc + req).to(tl.int64)
    if PDL:  # the batch's metadata and the layer's weights above are fixed for the forward; q, k, v are
        tl.extra.cuda.gdc_launch_dependents()  # the kernel before's
        tl.extra.cuda.gdc_wait()
    # q's loads are issued before the new K/V's store, so that their reads overlap (no measurable gain
    # on an H100, Qwen3-30B-A3B batch 1 309.2 -> 309.7 tok/s; nor from asking L2 for the chunk's first
    # K/V rows before the wait: 310.0; benchmarks/RESULTS.md 2026-12-06). Asking L2 here for the
    # layer's o_proj weights (bulk prefetches, so that o_proj would read what HBM brought in while this
    # latency-bound launch left it idle) was 2.3% slower after the wait, no faster before it (same day).
    # (An empty chunk's program reads none of it: its loads are masked off.)
    q_rows = Q + row * stride_qb + heads[:, None] * stride_qh
    q_mask = mask_hd & ((start + tl.zeros_like(in_group)) < end)[:, None]
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    qp = q
    if ROTATE:
        qp = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
    if STORE:  # the chunk that holds the new token (split 0 for seq_len 0) stores it first
        if split == tl.maximum(non_empty - 1, 0):
            _store_new_kv(KNew, VNew, KBuf, VBuf, slot, cos, sin, kw, kwp, KScale, VScale, req, kv_head, norm_eps,
                          stride_kn, stride_kh, stride_vn, stride_vh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                          offs_d, partner, first, mask_d, HEAD_DIM, ROTATE, HEAD_NORM, KV_FP8, FMAX)
            # The stores precede this program's own reads of the slot (a CTA barrier orders global
            # memory within the block); other head blocks of the chunk store the same bytes themselves.
            tl.debug_barrier()
    if start >= end:
        if non_empty == 0 and split == 0:  # seq_len 0: no chunk at all, the output is zeros
            tl.store(out_ptrs, tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(Out.dtype.element_ty), mask=mask_hd)
        return
    qk_scale, v_scale = kv_scales(qk_scale, KScale, VScale, KV_FP8)

    if ROTATE:  # the query heads as the store kernel would have rotated them (rounded to q's dtype)
        qf = q.to(tl.float32)
        inv = tl.full([BLOCK_H, 1], 1.0, tl.float32)
        if HEAD_NORM:
            inv = tl.math.rsqrt(tl.sum(qf * qf, axis=1) / HEAD_DIM + norm_eps)[:, None]
        q = _rope_normed(qf, qp.to(tl.float32), first[None, :], cos[None, :], sin[None, :], inv,
                         qw[None, :], qwp[None, :], Q.dtype.element_ty, HEAD_NORM).to(Q.dtype.element_ty)
    m_i = tl.full([BLOCK_H], M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if KV_FP8 and not IEEE:
        # FP8 keys and values convert to fp16 in one instruction per pair, to bf16 only through
        # float32: q joins them in fp16, scaled first (so that its range is the scores', far inside
        # fp16's; its rounding, 2^-11, is below bf16's own), and the loop's scale is then 1.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    # The chunk lies inside the window: no per-row mask (every head row is the same query position).
    m_i, l_i, acc = attend_pool(q, m_i, l_i, acc, row_base, slots, start, end, KBuf, VBuf, kv_head,
                                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_n, offs_d, mask_d,
                                qk_scale, cap_log2, m_i, False, HAS_CAP, BLOCK_N, IEEE)
    # The chunk is non-empty, so l_i > 0 for every head row.
    o = acc * (v_scale / l_i)[:, None]
    lse = m_i + tl.log2(l_i)

    if HAS_SINKS:  # the sink as a first chunk: log-sum-exp = the sink (base 2 here), value zero
        m_r = tl.load(Sinks + heads, mask=mask_h, other=0.0) * 1.4426950408889634
        l_r = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        m_r = tl.full([BLOCK_H], M_INIT, tl.float32)
        l_r = tl.zeros([BLOCK_H], tl.float32)
    acc_r = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if non_empty == 1:
        m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, lse, o)
        tl.store(out_ptrs, (acc_r / l_r[:, None]).to(Out.dtype.element_ty), mask=mask_hd)
    else:
        mid_o = MidO + req * stride_mob + heads[:, None] * stride_moh + offs_d[None, :]
        mid_lse = MidLse + req * stride_mlb + heads * stride_mlh
        tl.store(mid_o + split * stride_mos, o, mask=mask_hd)
        tl.store(mid_lse + split, lse, mask=mask_h)
        tl.debug_barrier()  # every thread's chunk stores precede the counter update
        counter = Counters + req * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == non_empty - 1:  # the last of the request's chunks to finish merges them all
            tl.store(counter, 0)
            if MERGE_S > 0:
                _merge_tile(MidO, MidLse, Out, Sinks, req, row, kv_head, head_block, non_empty, stride_mob, stride_moh,
                            stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, offs_d, mask_d, GROUP, BLOCK_H,
                            MERGE_H, MERGE_S, M_INIT, HAS_SINKS)
            else:
                for c in range(0, non_empty):
                    lse_c = tl.load(mid_lse + c, mask=mask_h, other=0.0, cache_modifier=".cg")
                    o_c = tl.load(mid_o + c * stride_mos, mask=mask_hd, other=0.0, cache_modifier=".cg")
                    m_r, l_r, acc_r = _merge(m_r, l_r, acc_r, lse_c, o_c)
                tl.store(out_ptrs, (acc_r / l_r[:, None]).to(Out.dtype.element_ty), mask=mask_hd)


def head_block_size(group: int) -> int:
    """Query heads per decode program: the whole GQA group (padded to a power of two, at least 16 for
    tl.dot), capped at 64 to bound registers; larger groups take several programs per kv head."""
    return min(64, max(16, triton.next_power_of_2(group)))


def _block_n(head_dim: int) -> int:
    """Keys per decode iteration. 128 was fastest or within 4% of the fastest launch setting (with
    num_warps 4, num_stages 2) at every H200 shape swept by benchmarks/gpu_profile.py for head_dim 128
    (batch 1-256, context 512-4096); head_dim 256 keeps smaller tiles to fit shared memory."""
    return 128 if head_dim <= 128 else 32


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    grid_splits: int,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    counters: torch.Tensor,
    scaling: float,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    *,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    min_split_len: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_rows: torch.Tensor | None = None,
    store: DecodeStore | None = None,
) -> None:
    """Write into `out` [bs, H, D] the attention of q [bs, H, D] (one new token per request) over
    request b's keys req_to_token[req_pool_indices[b], 0:seq_lens[b]] in the pool. With `q_rows`
    (int32 [bs]; the one-token rows of an extend batch) request b's query is q[q_rows[b]] and its
    result goes to out[q_rows[b]]; q and out may then have any number of rows, and no other row is
    read or written.

    num_kv_splits [bs] int32 holds each request's chunk count (>= 1, <= grid_splits); mid_o
    [>= bs, H, >= grid_splits, D] and mid_lse [>= bs, H, >= grid_splits] fp32 are scratch; counters
    int32 [>= bs * num_kv_heads * head_blocks] are zeros and left zeroed (`counters_needed`). Only
    tensor contents vary between calls with the same shapes and grid_splits, so the launch can be
    replayed from a CUDA graph. block_h / block_n override the tuned sizes (powers of two, at least 16).
    The optional features are the layer's (`rxf.core.attention.AttentionLayer`); with a window a
    request uses at most cdiv(min(seq_len, window), min_split_len) of its chunks. k_scale / v_scale
    are the layer's too, needed by an FP8 pool. `store` (not with q_rows): the launch first stores the
    new tokens' K/V itself and takes q unrotated (`DecodeStore`).
    """
    _, num_heads, head_dim = q.shape
    bs = q.shape[0] if q_rows is None else q_rows.shape[0]
    num_kv_heads = k_buf.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert mid_o.shape[2] >= grid_splits and mid_lse.shape[2] >= grid_splits, "scratch too small"
    for t in (q, out, k_buf, v_buf, req_to_token, mid_o, mid_lse):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    if bs == 0:
        return
    group = num_heads // num_kv_heads
    block_h = block_h or head_block_size(group)
    head_blocks = triton.cdiv(group, block_h)
    assert counters.numel() >= bs * num_kv_heads * head_blocks, "too few counters"
    block_d = max(16, triton.next_power_of_2(head_dim))
    features = feature_args(scaling, sliding_window, logit_cap, sinks, q)
    scales = kv_scale_args(k_buf, k_scale, v_scale, q)
    new = _store_args(store, q, k_buf, q_rows)
    pdl = use_pdl(q)
    _decode_kernel[(bs, num_kv_heads * head_blocks, grid_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits, mid_o, mid_lse, counters, out,
        out if q_rows is None else q_rows,  # (a placeholder without rows: never read)
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        features["qk_scale"], features["cap_log2"], features["window"], min_split_len,
        scales["KScale"], scales["VScale"], features["Sinks"], *new["args"],
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_N=block_n or _block_n(head_dim), BLOCK_D=block_d, M_INIT=_M_INIT,
        IEEE=q.dtype == torch.float32, HAS_WINDOW=features["HAS_WINDOW"], HAS_CAP=features["HAS_CAP"],
        HAS_SINKS=features["HAS_SINKS"], KV_FP8=scales["KV_FP8"], HAS_Q_ROWS=q_rows is not None, PDL=pdl,
        **new["constexprs"], **_merge_shape(group, block_h, grid_splits), num_warps=num_warps, num_stages=num_stages,
        launch_pdl=pdl,
    )


MERGE_TILE_LIMIT = 128  # the most MERGE_H x MERGE_S values a tile merge holds (see `_merge_shape`)


def _merge_shape(group: int, block_h: int, grid_splits: int) -> dict[str, int]:
    """MERGE_H / MERGE_S of the tile merge (`_merge_tile`), or MERGE_S 0 for the chunk-by-chunk loop: the
    tile holds MERGE_H x MERGE_S x head_dim float32 values in registers, so it is taken only while
    MERGE_H * MERGE_S <= MERGE_TILE_LIMIT (128 registers a thread at head_dim 128 over 4 warps). On an
    H100 at batch 1 (benchmarks/gpu_attn_decode.py, the backend's split counts, 3-16 chunks) the tile
    took a launch from 5.3-13.1 us to 4.8-10.1 us (the loop's chunk loads wait on one another), and 128
    values merged as fast as 64."""
    merge_h = min(block_h, triton.next_power_of_2(group))
    merge_s = triton.next_power_of_2(grid_splits)
    if grid_splits < 2 or merge_h * merge_s > MERGE_TILE_LIMIT:
        merge_s = 0
    return {"MERGE_H": merge_h, "MERGE_S": merge_s}


class DecodeStore(NamedTuple):
    """What the decode launch needs to store the batch's new tokens itself, one launch per layer instead
    of the rope + K/V store's and this one's: k and v `[bs, kv_heads, head_dim]` (last dimension
    contiguous), `loc` [bs] their pool slots; `rope` (positions [bs], float32 cos | sin table
    `[max_position, head_dim]`) or None for no rotation; `head_norm` (with rope only) Qwen3's per-head
    norms. Every program whose chunk holds its request's new token (the last chunk; split 0 for a
    request of seq_len 0) stores it, as `store_kv.rope_store_kv` would, before reading the pool;
    every program rotates (and normalises) its query heads itself. Unlike `rope_store_kv` it writes
    neither q nor k back."""

    k: torch.Tensor
    v: torch.Tensor
    loc: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    head_norm: HeadNorm | None = None


def _store_args(store: DecodeStore | None, q: torch.Tensor, k_buf: torch.Tensor, q_rows: torch.Tensor | None):
    """The kernel's arguments for `store` (placeholders, never read, without one)."""
    if store is None:
        return {"args": (q, q, q, q, q, q, q, 0.0, 0, 0, 0, 0, 0),
                "constexprs": {"STORE": False, "ROTATE": False, "HEAD_NORM": False, "FMAX": 0.0}}
    assert q_rows is None, "the store is for decode batches, one new token per row of q"
    k, v = store.k, store.v
    assert k.shape == v.shape == (q.shape[0], k_buf.shape[1], q.shape[2]), "k and v: [bs, kv_heads, head_dim]"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.shape[2] % 2 == 0
    positions, cos_sin = store.rope if store.rope is not None else (store.loc, q)
    if store.rope is not None:
        assert cos_sin.dtype == torch.float32 and cos_sin.shape[-1] == q.shape[2] and cos_sin.stride(-1) == 1
    norm = store.head_norm
    assert norm is None or store.rope is not None, "head norms come with the rotation only"
    quant = is_fp8(k_buf.dtype)
    return {
        "args": (k, v, store.loc, positions, cos_sin, norm.q_weight if norm else q, norm.k_weight if norm else q,
                 norm.eps if norm else 0.0, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0)),
        "constexprs": {"STORE": True, "ROTATE": store.rope is not None, "HEAD_NORM": norm is not None,
                       "FMAX": torch.finfo(k_buf.dtype).max if quant else 0.0},
    }


def counters_needed(bs: int, num_heads: int, num_kv_heads: int) -> int:
    """How many counters `decode_attention` needs for a batch of `bs` at the default head blocks."""
    group = num_heads // num_kv_heads
    return bs * num_kv_heads * triton.cdiv(group, head_block_size(group))
