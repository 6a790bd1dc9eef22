"""Extend (and prefill) attention over the page-size-1 KV pool: one Triton kernel, online softmax.

Grid: (cdiv(max_extend_len, BLOCK_M), num_heads, batch_size); program (m, h, b) owns query rows
[m * BLOCK_M, (m + 1) * BLOCK_M) of request b's new tokens, query head h. Region map of that program:
  reads  q[qo_start[b] + rows, h, :]                          (rows < extend_len[b])
         pool K/V at slots req_to_token[row_b, lo:prefix_len[b]], kv head h // GROUP
         k/v inputs at rows qo_start[b] + [lo', min(extend_len[b], (m + 1) * BLOCK_M)), kv head h // GROUP
         (causal: new key j is seen by new query i iff j <= i)
  writes out[qo_start[b] + rows, h, :]                          (rows < extend_len[b])
Programs whose row block starts past extend_len[b] exit at once (the grid is sized by the longest).
lo = lo' = 0 without a window. With a sliding window W the query at absolute position i sees keys
i - W < j <= i: the loops start at the block's first row's first visible key (lo, lo'), so keys older
than the window are never loaded (a long cached prefix costs W keys per row block, not its length),
and a per-row mask cuts the rest.

The other optional features (`feature_args`): a logit soft-cap c turns each scaled score s into
c * tanh(s / c) before the softmax; sinks start each row's online softmax with one extra logit (the
head's sink) of weight exp(sink) and zero value, which is exactly its share of the denominator.

The new tokens' K/V are read from the k/v inputs rather than back from the pool: contiguous rows, no
slot indirection, and no ordering dependence on the pool write. They equal the pool's copies while the
pool stores the model dtype. An FP8 pool (KV_FP8) is the exception: the new tokens' K/V are read back
from it (through req_to_token, after the store launch on the same stream), so that every key is
attended as quantized, as torch_native does, and a token's attention does not depend on whether its
keys were cached or computed in this forward.

FP8 K/V (`kv_scale_args`) are upcast to q's dtype in registers (exact: every e4m3 / e5m2 value is a
bf16, fp16 and fp32 value) and their per-tensor scales applied in float32 where they cost nothing:
k_scale multiplies the score scale (s = (q . k8) * scaling * k_scale, before any soft-cap), v_scale the
normalised output (every value read carries the same scale).

Scores are kept in base 2 (the softmax scale is multiplied by log2(e)) so the kernel can use exp2;
accumulation is fp32 whatever the input dtype; the output is written in `out`'s dtype.
"""

from __future__ import annotations

import math
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
                IEEE: tl.constexpr):
    """Fold one key block into the running (max, sum, weighted-sum) of each query row; masked keys
    (mask False) contribute nothing. Scores are scaled (and soft-capped) into base 2 as
    `feature_args` says. Shared by the extend and decode kernels."""
    s = _dot(q, tl.trans(k), IEEE)
    if HAS_CAP:
        s = cap_log2 * _tanh(s * qk_scale)
    else:
        s = s * qk_scale
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
                                    qk_scale, cap_log2, HAS_CAP, IEEE)
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K, V, Out, KBuf, VBuf, ReqToToken,
    req_pool_indices, prefix_lens, extend_lens, qo_start,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    qk_scale, cap_log2, window, Sinks, KScale, VScale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, M_INIT: tl.constexpr,
    IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    extend_len = tl.load(extend_lens + req)
    if m_block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(prefix_lens + req)
    first = tl.load(qo_start + req).to(tl.int64)  # this request's first row in q/k/v/out
    row_base = ReqToToken + tl.load(req_pool_indices + req).to(tl.int64) * stride_r2t
    kv_head = head // GROUP
    qk_scale, v_scale = kv_scales(qk_scale, KScale, VScale, KV_FP8)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM  # BLOCK_D is HEAD_DIM rounded up to a power of two

    q = tl.load(
        Q + (first + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :], other=0.0,
    )
    if HAS_SINKS:  # the sink as a first key: logit sink (base 2 here), weight 1 after its own max, no value
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(Sinks + head) * 1.4426950408889634
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
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
    # Cached prefix, slots through req_to_token.
    m_i, l_i, acc = attend_pool(q, m_i, l_i, acc, row_base, pool_slots(row_base, lo, prefix_len, offs_n), lo,
                                prefix_len, KBuf, VBuf, kv_head,
                                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_n, offs_d, mask_d,
                                qk_scale, cap_log2, first_key, HAS_WINDOW, HAS_CAP, BLOCK_N, IEEE)

    # New tokens, causal: keys past this block's last row are never needed; with a window, neither
    # are new keys before the first row's window (new key j sits at position prefix_len + j).
    end_n = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
    lo_n = 0
    if HAS_WINDOW:
        lo_n = tl.maximum(m_block * BLOCK_M - window + 1, 0)
    for start_n in range(lo_n, end_n, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < extend_len
        kv_mask = mask_n[:, None] & mask_d[None, :]
        if KV_FP8:  # the pool's quantized copies (see the module docstring)
            slots = tl.load(row_base + prefix_len + cols, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
        else:
            k = tl.load(K + (first + cols)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V + (first + cols)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
        # cols <= row also implies cols < extend_len for every stored row (rows < extend_len).
        visible = cols[None, :] <= offs_m[:, None]
        if HAS_WINDOW:
            visible = visible & (prefix_len + cols[None, :] >= first_key[:, None])
        m_i, l_i, acc = online_step(q, k.to(q.dtype), v.to(q.dtype), visible, m_i, l_i, acc,
                                    qk_scale, cap_log2, HAS_CAP, IEEE)

    # Every stored row saw at least its own key, so l_i > 0 there; padding rows are not stored.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(
        Out + (first + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :],
    )


def _config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the fp32 accumulator is BLOCK_M x BLOCK_D, so the
    key block shrinks and warps double at head_dim 256 to stay within registers and shared memory."""
    if head_dim <= 128:
        return 64, 64, 4, 2
    return 64, 32, 8, 2


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
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write into `out` [T, H, D] the attention of q [T, H, D] (the new tokens, flattened in request
    order; request b's rows start at qo_start[b]) over each request's cached prefix in the pool and its
    new k/v [T, Hkv, D]. Tensors may be strided views but their last dimension must be contiguous.
    block_m / block_n override the tuned block sizes (powers of two, at least 16). The optional
    features are the layer's (`rxf.core.attention.AttentionLayer`); so are k_scale / v_scale, which an
    FP8 pool needs (its new tokens must already be stored, see the module docstring)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    for t in (q, k, v, out, k_buf, v_buf, req_to_token):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    cfg_m, cfg_n, num_warps, num_stages = _config(head_dim)
    block_m, block_n = block_m or cfg_m, block_n or cfg_n
    batch_size = int(req_pool_indices.shape[0])
    if batch_size == 0 or max_extend_len == 0:
        return
    grid = (triton.cdiv(max_extend_len, block_m), num_heads, batch_size)
    _extend_kernel[grid](
        q, k, v, out, k_buf, v_buf, req_to_token,
        req_pool_indices, prefix_lens, extend_lens, qo_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        M_INIT=_M_INIT, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
        **feature_args(scaling, sliding_window, logit_cap, sinks, q), **kv_scale_args(k_buf, k_scale, v_scale, q),
    )
