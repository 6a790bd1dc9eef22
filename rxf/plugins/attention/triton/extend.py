"""Extend (and prefill) attention over the page-size-1 KV pool: one Triton kernel, online softmax.

Grid: (cdiv(max_extend_len, TOKENS), H', batch_size); program (m, h', b) owns query tokens
[m * TOKENS, (m + 1) * TOKENS) of request b's new tokens. Unpacked, h' is the query head (H' =
num_heads, TOKENS = BLOCK_M); packed (`PACK_GQA`, where the GROUP query heads of a KV head divide
BLOCK_M), h' is the KV head, H' = num_kv_heads, TOKENS = BLOCK_M / GROUP, and the block's BLOCK_M rows
are its tokens x the GROUP heads, token-major. Region map of that program (rows: its tokens; heads:
its query heads; kv: their KV head):
  reads  q[qo_start[b] + rows, heads, :]                      (rows < extend_len[b])
         pool K/V at slots req_to_token[row_b, lo:prefix_len[b]], kv
         k/v inputs at rows qo_start[b] + [lo', min(extend_len[b], (m + 1) * TOKENS)), kv
         (causal: new key j is seen by new query i iff j <= i; the key blocks that end at or before
         the first token, below the diagonal, are seen whole and run without the mask)
  writes out[qo_start[b] + rows, heads, :]                    (rows < extend_len[b])
Programs whose token block starts past extend_len[b] exit at once (the grid is sized by the longest).
lo = lo' = 0 without a window. With a sliding window W the query at absolute position i sees keys
i - W < j <= i: the loops start at the block's first token's first visible key (lo, lo'), so keys
older than the window are never loaded (a long cached prefix costs W keys per row block, not its
length), and a per-row mask cuts the rest (every new-key block is then masked).

The other optional features (`feature_args`): a logit soft-cap c turns each scaled score s into
c * tanh(s / c) before the softmax; sinks start each row's online softmax with one extra logit (the
head's sink) of weight exp(sink) and zero value, which is exactly its share of the denominator.

The new tokens' K/V are read from the k/v inputs rather than back from the pool: contiguous rows, no
slot indirection, and no ordering dependence on the pool write. They equal the pool's copies while the
pool stores the model dtype. An FP8 pool (KV_FP8) is the exception: the new tokens' K/V are read back
from it (through req_to_token, after the store launch on the same stream), so that every key is
attended as quantized, as torch_native does, and a token's attention does not depend on whether its
keys were cached or computed in this forward.

FP8 K/V (`kv_scale_args`) are upcast in registers (exact: every e4m3 / e5m2 value is a bf16, fp16 and
fp32 value) and their per-tensor scales applied where they cost nothing: k_scale multiplies the score
scale (s = (q . k8) * scaling * k_scale, before any soft-cap), v_scale the normalised output (every
value read carries the same scale). With a half-precision q they are upcast to fp16, one instruction a
pair, and q is multiplied by the score scale and rounded to fp16 once (as decode.py does; |q * scale|
must stay below 65504): on sm_90 the packed loops' SASS went from 1,188 / 1,043 to 901 / 753
instructions at 128 rows and 4 warps, 735 / 666 / 804 to 512 / 452 / 585 at 64 (not yet timed).

Scores are kept in base 2 (the softmax scale is multiplied by log2(e)) so the kernel can use exp2;
accumulation is fp32 whatever the input dtype; the output is written in `out`'s dtype.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

from rxf.core.kv_pool import is_fp8

_LOG2E = 1.0 / math.log(2.0)
# Running-max start value: finite, so a row whose keys are all masked so far gives exp2(-inf - m) = 0
# and exp2(m_old - m_new) = 1 instead of NaN from (-inf) - (-inf).
_M_INIT = -1.0e30


def kv_scale_args(
    k_buf: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, placeholder: torch.Tensor
) -> dict[str, Any]:
    """The kernels' arguments for the pool's format: KV_FP8 with the layer's scale pointers (float32
    0-d, both required), else placeholders that are never read."""
    fp8 = is_fp8(k_buf.dtype)
    if fp8:
        assert k_scale is not None and v_scale is not None, "an FP8 pool needs the layer's k_scale and v_scale"
        assert k_scale.dtype == v_scale.dtype == torch.float32, "KV-cache scales must be float32"
    return {
        "KScale": k_scale if fp8 else placeholder,
        "VScale": v_scale if fp8 else placeholder,
        "KV_FP8": fp8,
    }


@triton.jit
def kv_scales(qk_scale, KScale, VScale, KV_FP8: tl.constexpr):
    """(score scale with k_scale folded in, v_scale) for an FP8 pool; (qk_scale, 1.0) otherwise."""
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(KScale)
        v_scale = tl.load(VScale)
    return qk_scale, v_scale


def feature_args(
    scaling: float, sliding_window: int | None, logit_cap: float | None, sinks: torch.Tensor | None,
    placeholder: torch.Tensor,
) -> dict[str, Any]:
    """The kernels' arguments for a layer's scale and optional features. Scores end in base 2:
    qk_scale = scaling * log2(e) without a cap; with cap c, s2 = cap_log2 * tanh(qk * qk_scale) where
    qk_scale = scaling / c and cap_log2 = c * log2(e). Sinks (float32 [num_heads]) are read in natural
    units; `placeholder` stands in for the pointer when there are none (never read)."""
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous(), "sinks must be contiguous float32"
    return {
        "qk_scale": scaling * _LOG2E if logit_cap is None else scaling / logit_cap,
        "cap_log2": 0.0 if logit_cap is None else logit_cap * _LOG2E,
        "window": sliding_window or 0,
        "Sinks": placeholder if sinks is None else sinks,
        "HAS_WINDOW": sliding_window is not None,
        "HAS_CAP": logit_cap is not None,
        "HAS_SINKS": sinks is not None,
    }


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE keeps fp32 inputs in full precision (tl.dot would use TF32,
    ~1e-3 relative error, enough to flip greedy tokens of a float32 model). No effect on fp16/bf16."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tanh(x):
    """tanh from exp2 of -2|x| (no overflow; absolute error ~1e-7 in fp32): libdevice's has no
    interpreter implementation."""
    e = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|); the constant is 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def online_step(q, k, v, mask, m_i, l_i, acc, qk_scale, cap_log2, HAS_CAP: tl.constexpr,
                IEEE: tl.constexpr, MASKED: tl.constexpr):
    """Fold one key block into the running (max, sum, weighted-sum) of each query row; masked keys
    (mask False) contribute nothing. MASKED False: every key of the block is visible to every row and
    `mask` is not read (a causal extend's blocks below the diagonal). Scores are scaled (and
    soft-capped) into base 2 as `feature_args` says. Shared by the extend and decode kernels."""
    s = _dot(q, tl.trans(k), IEEE)
    if HAS_CAP:
        s = cap_log2 * _tanh(s * qk_scale)
    else:
        s = s * qk_scale
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def pool_slots(row_base, start, end, offs_n):
    """The pool slots of positions start + offs_n (those before `end`; 0 past it) of a request's
    req_to_token row: `attend_pool`'s first block, which a caller may read early."""
    cols = start + offs_n
    return tl.load(row_base + cols, mask=cols < end, other=0).to(tl.int64)


@triton.jit
def attend_pool(q, m_i, l_i, acc, row_base, slots, start, end, KBuf, VBuf, kv_head,
                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_n, offs_d, mask_d, qk_scale, cap_log2,
                row_first, ROW_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_N: tl.constexpr,
                IEEE: tl.constexpr):
    """Fold the pooled keys of positions [start, end) of one request (slots read through its
    req_to_token row `row_base`, KV head `kv_head`; `slots`: the first block's, `pool_slots`') into
    every query row's running state; with ROW_WINDOW, row r sees only keys at positions >= row_first[r].
    Each block's K/V loads issue the next block's slot loads before its math. Shared by extend (the
    cached prefix) and decode (one split of the context)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < end
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        slots = pool_slots(row_base, start_n + BLOCK_N, end, offs_n)
        mask = mask_n[None, :]
        if ROW_WINDOW:
            mask = mask & (cols[None, :] >= row_first[:, None])
        m_i, l_i, acc = online_step(q, k.to(q.dtype), v.to(q.dtype), mask, m_i, l_i, acc,
                                    qk_scale, cap_log2, HAS_CAP, IEEE, True)
    return m_i, l_i, acc


@triton.jit
def _attend_new(q, m_i, l_i, acc, start, end, K, V, KBuf, VBuf, row_base, first, prefix_len, extend_len, kv_head,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                offs_m, offs_n, offs_d, mask_d, first_key, qk_scale, cap_log2, MASKED: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                KV_FP8: tl.constexpr, EVEN_D: tl.constexpr):
    """Fold the new keys [start, end) of one request into every query row's running state, causally
    (and by the window) when MASKED; unmasked, the caller guarantees every key is visible to every
    row and below extend_len, and with EVEN_D (head_dim a power of two) the loads carry no mask."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        fill = 0.0
        if MASKED:
            kv_mask = (cols < extend_len)[:, None] & mask_d[None, :]
        elif EVEN_D:
            kv_mask, fill = None, None
        else:
            kv_mask = mask_d[None, :]
        if KV_FP8:  # the pool's quantized copies (see the module docstring)
            slots = tl.load(row_base + prefix_len + cols, mask=cols < extend_len, other=0).to(tl.int64)
            k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                        mask=kv_mask, other=fill)
            v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                        mask=kv_mask, other=fill)
        else:
            k = tl.load(K + (first + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=fill)
            v = tl.load(V + (first + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=fill)
        # cols <= row also implies cols < extend_len for every stored row (rows < extend_len).
        visible = cols[None, :] <= offs_m[:, None]
        if HAS_WINDOW:
            visible = visible & (prefix_len + cols[None, :] >= first_key[:, None])
        m_i, l_i, acc = online_step(q, k.to(q.dtype), v.to(q.dtype), visible, m_i, l_i, acc,
                                    qk_scale, cap_log2, HAS_CAP, IEEE, MASKED)
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K, V, Out, KBuf, VBuf, ReqToToken,
    req_pool_indices, prefix_lens, extend_lens, qo_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    qk_scale, cap_log2, window, Sinks, KScale, VScale,
    GROUP: tl.constexpr, PACK: tl.constexpr, TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, M_INIT: tl.constexpr,
    IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    m_block = tl.program_id(0)
    req = tl.program_id(2)
    extend_len = tl.load(extend_lens + req)
    if m_block * TOKENS >= extend_len:
        return
    prefix_len = tl.load(prefix_lens + req)
    first = tl.load(qo_start + req).to(tl.int64)  # this request's first row in q/k/v/out
    row_base = ReqToToken + tl.load(req_pool_indices + req).to(tl.int64) * stride_r2t
    qk_scale, v_scale = kv_scales(qk_scale, KScale, VScale, KV_FP8)

    # Row r of the block: query token offs_m[r] of this request, query head heads[r]. PACK: the GROUP
    # heads that share KV head program_id(1) fill the rows token-major (TOKENS = BLOCK_M / GROUP
    # tokens), so each K/V tile read serves all of them; else one head, TOKENS = BLOCK_M tokens.
    offs_r = tl.arange(0, BLOCK_M)
    if PACK:
        kv_head = tl.program_id(1)
        heads = kv_head * GROUP + offs_r % GROUP
        offs_m = m_block * TOKENS + offs_r // GROUP
    else:
        kv_head = tl.program_id(1) // GROUP
        heads = tl.program_id(1) + offs_r * 0
        offs_m = m_block * TOKENS + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM  # BLOCK_D is HEAD_DIM rounded up to a power of two

    q = tl.load(
        Q + ((first + offs_m) * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    if KV_FP8 and not IEEE:
        # As in decode.py: FP8 keys and values convert to fp16 in one instruction a pair, to bf16 only
        # through float32, so q joins them in fp16, scaled first (its range is then the scores', far
        # inside fp16's; its rounding, 2^-11, is below bf16's own), and the loops' scale is 1.
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    if HAS_SINKS:  # the sink as a first key: logit sink (base 2 here), weight 1 after its own max, no value
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(Sinks + heads) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], M_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Row r (absolute position prefix_len + r) sees keys from position prefix_len + r - window + 1 on;
    # the block's first row sees the oldest. Without a window every row sees the whole prefix.
    first_key = prefix_len + offs_m - window + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix_len + m_block * TOKENS - window + 1, 0)
    # Cached prefix, slots through req_to_token.
    m_i, l_i, acc = attend_pool(q, m_i, l_i, acc, row_base, pool_slots(row_base, lo, prefix_len, offs_n), lo,
                                prefix_len, KBuf, VBuf, kv_head,
                                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_n, offs_d, mask_d,
                                qk_scale, cap_log2, first_key, HAS_WINDOW, HAS_CAP, BLOCK_N, IEEE)

    # New tokens, causal: keys past this block's last row are never needed; with a window, neither
    # are new keys before the first row's window (new key j sits at position prefix_len + j). Without
    # a window the key blocks that end at or before the block's first row are seen whole by every row:
    # they skip the mask (most of a long prompt's blocks), the blocks across the diagonal apply it.
    end_n = tl.minimum(extend_len, (m_block + 1) * TOKENS)
    lo_n = 0
    full_end = (m_block * TOKENS) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:  # every block masked: [lo_n, lo_n) is empty
        lo_n = tl.maximum(m_block * TOKENS - window + 1, 0)
        full_end = lo_n
    m_i, l_i, acc = _attend_new(q, m_i, l_i, acc, lo_n, full_end, K, V, KBuf, VBuf, row_base, first, prefix_len,
                                extend_len, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, stride_kbs,
                                stride_kbh, stride_vbs, stride_vbh, offs_m, offs_n, offs_d, mask_d, first_key,
                                qk_scale, cap_log2, False, HAS_WINDOW, HAS_CAP, BLOCK_N, IEEE, KV_FP8,
                                BLOCK_D == HEAD_DIM)
    m_i, l_i, acc = _attend_new(q, m_i, l_i, acc, full_end, end_n, K, V, KBuf, VBuf, row_base, first, prefix_len,
                                extend_len, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, stride_kbs,
                                stride_kbh, stride_vbs, stride_vbh, offs_m, offs_n, offs_d, mask_d, first_key,
                                qk_scale, cap_log2, True, HAS_WINDOW, HAS_CAP, BLOCK_N, IEEE, KV_FP8,
                                BLOCK_D == HEAD_DIM)

    # Every stored row saw at least its own key, so l_i > 0 there; padding rows are not stored.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(
        Out + ((first + offs_m) * stride_ot + heads * stride_oh)[:, None] + offs_d[None, :],
        out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


# Whether a program's query rows are the GROUP heads of one KV head over BLOCK_M / GROUP tokens
# (each K/V tile read once for them all, and a diagonal block spans fewer tokens) rather than one head
# over BLOCK_M tokens. On an H100, Llama-3-8B's heads, a 17k-token prefill chunk: 560.8 -> 536.9 us
# (bf16), 854.1 -> 746.1 us over an FP8 pool with its 128-row blocks (benchmarks/RESULTS.md, 2026-12-07).
PACK_GQA = True


def _config(head_dim: int, kv_fp8: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the fp32 accumulator is BLOCK_M x BLOCK_D, so the
    key block shrinks and warps double at head_dim 256 to stay within registers and shared memory. An
    FP8 pool's keys come through the slot gather and an upcast, which 128-row blocks amortize (746 us
    against 818 at 64 rows, packed; the model dtype's 64 rows: 537 against 647 at 128 with 4 warps)."""
    if head_dim <= 128:
        return (128, 64, 4, 2) if kv_fp8 else (64, 64, 4, 2)
    return 64, 32, 8, 2


ENV = "RXF_EXTEND"


@functools.cache
def _env_settings() -> tuple[tuple[int, int, int, int], bool] | None:
    """`RXF_EXTEND=[p]BLOCK_M,BLOCK_N,num_warps,num_stages` (read once per process; benchmarks): the
    launch settings for every head_dim, `p` packing the GQA heads (`PACK_GQA`)."""
    value = os.environ.get(ENV, "")
    if not value:
        return None
    try:
        m, n, warps, stages = (int(x) for x in value.removeprefix("p").split(","))
    except ValueError:
        expected = "expected [p]BLOCK_M,BLOCK_N,num_warps,num_stages, e.g. p128,64,8,2"
        raise ValueError(f"{ENV}={value!r}: {expected}") from None
    if min(m, n) < 16 or m & (m - 1) or n & (n - 1):
        raise ValueError(f"{ENV}={value!r}: BLOCK_M and BLOCK_N must be powers of two, at least 16")
    return (m, n, warps, stages), value.startswith("p")


def check_env_settings() -> None:
    """Raise ValueError, naming `RXF_EXTEND`, if it is set and malformed."""
    _env_settings()


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack_gqa: bool | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write into `out` [T, H, D] the attention of q [T, H, D] (the new tokens, flattened in request
    order; request b's rows start at qo_start[b]) over each request's cached prefix in the pool and its
    new k/v [T, Hkv, D]. Tensors may be strided views but their last dimension must be contiguous.
    block_m / block_n (powers of two, at least 16), num_warps, num_stages and pack_gqa override the
    tuned launch settings (`RXF_EXTEND`, else `_config` and `PACK_GQA`); packing takes effect where the
    query heads of a KV head divide block_m. The optional features are the layer's
    (`rxf.core.attention.AttentionLayer`); so are k_scale / v_scale, which an FP8 pool needs (its new
    tokens must already be stored, see the module docstring)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    for t in (q, k, v, out, k_buf, v_buf, req_to_token):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    env = _env_settings()
    (cfg_m, cfg_n, cfg_warps, cfg_stages), cfg_pack = env or (_config(head_dim, is_fp8(k_buf.dtype)), PACK_GQA)
    block_m, block_n = block_m or cfg_m, block_n or cfg_n
    num_warps, num_stages = num_warps or cfg_warps, num_stages or cfg_stages
    batch_size = int(req_pool_indices.shape[0])
    if batch_size == 0 or max_extend_len == 0:
        return
    group = num_heads // num_kv_heads
    pack = (cfg_pack if pack_gqa is None else pack_gqa) and group > 1 and block_m % group == 0
    tokens = block_m // group if pack else block_m
    grid = (triton.cdiv(max_extend_len, tokens), num_kv_heads if pack else num_heads, batch_size)
    _extend_kernel[grid](
        q, k, v, out, k_buf, v_buf, req_to_token,
        req_pool_indices, prefix_lens, extend_lens, qo_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        GROUP=group, PACK=pack, TOKENS=tokens, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        M_INIT=_M_INIT, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
        **feature_args(scaling, sliding_window, logit_cap, sinks, q), **kv_scale_args(k_buf, k_scale, v_scale, q),
    )
