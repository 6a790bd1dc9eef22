"""Writing new tokens' K and V into the page-size-1 pool in one Triton launch, optionally rotating q
and k by their positions first (rotary embedding fused into the store).

`TokenToKVPool.set_kv` does the store with two index_put kernels, and the model's rotary embedding is
one more launch; at batch 1 with CUDA graphs each costs a few us of GPU time for a few KB, so one
launch per layer instead of two or three is what counts.

Grid: one program per (new token i, kv head h). Region map: the program reads loc[i] (and positions[i])
and k[i, h], v[i, h]; it writes k_buf[loc[i], h], v_buf[loc[i], h]. With rotation it also reads
q[i, h * group : (h + 1) * group] (the query heads sharing kv head h), writes those heads rotated to
q_out (which may be q itself), and writes k[i, h] rotated back in place (extend kernels read the new
keys from k, not from the pool). Slots are distinct within a batch, so programs never write the
same row.

An FP8 pool (QUANT) stores x / scale in float32, clamped to +-FMAX (the format's largest finite value:
e4m3fn has no infinity, an unclamped overflow would turn into NaN) and rounded to the pool's dtype,
as `rxf.core.kv_pool.quantize_kv` defines; the scales are the layer's float32 0-d tensors.

Rotation (NeoX rotate-half over the whole head, as `RotaryEmbedding`): with x1, x2 the halves of a
head and c, s the cos | sin halves of `cos_sin[positions[i]]` (float32), x -> (x1 c - x2 s, x2 c + x1 s),
computed in float32 and rounded once to each destination's dtype.

Head norms (HEAD_NORM, with rotation only; Qwen3's q_norm / k_norm): before rotating, each q and k head
vector is RMS-normalised over head_dim with its weight (`QNormW` for q heads, `KNormW` for k heads),
rounded as `head_norm.norm_heads_` rounds (normalised in float32, cast to the tensor's dtype,
multiplied by the weight in float32, cast again), so that the fused launch writes what the head-norm
kernel followed by this one would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.attention import HeadNorm
from rxf.core.kv_pool import is_fp8
from rxf.core.runner.pdl import use_pdl


@triton.jit
def _rotate_halves(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _head_normed(x, inv_rms, w, dtype):
    """A head's float32 values normalised by `inv_rms` and weighted by `w`, with RMSNorm's roundings."""
    return ((x * inv_rms).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def _to_pool(x, scale, dtype, FMAX: tl.constexpr, QUANT: tl.constexpr):
    """x as the pool stores it: quantized with `scale` (QUANT), else cast."""
    if QUANT:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FMAX, FMAX)  # IEEE division, as torch
    return x.to(dtype)


@triton.jit
def pool_scales(KScale, VScale, QUANT: tl.constexpr):
    """(k_scale, v_scale) an FP8 pool stores with (the layer's float32 0-d tensors); 1.0 otherwise."""
    k_scale = 1.0
    v_scale = 1.0
    if QUANT:
        k_scale = tl.load(KScale)
        v_scale = tl.load(VScale)
    return k_scale, v_scale


@triton.jit
def _store_kv_kernel(
    Q, QOut, K, V, KBuf, VBuf, Loc, Positions, CosSin, KScale, VScale, QNormW, KNormW, norm_eps,
    stride_qn, stride_qh, stride_qon, stride_qoh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_cs,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr, QUANT: tl.constexpr, FMAX: tl.constexpr, HEAD_NORM: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the previous kernel writes this one's inputs (rxf/core/runner/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(Loc + i).to(tl.int64)
    k_scale, v_scale = pool_scales(KScale, VScale, QUANT)
    kb_ty = KBuf.dtype.element_ty
    vb_ty = VBuf.dtype.element_ty
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    k_row = K + i * stride_kn + h * stride_kh
    v_row = V + i * stride_vn + h * stride_vh
    kb_row = KBuf + slot * stride_kbs + h * stride_kbh
    vb_row = VBuf + slot * stride_vbs + h * stride_vbh
    k1 = tl.load(k_row + offs, mask=mask, other=0.0)
    k2 = tl.load(k_row + HALF + offs, mask=mask, other=0.0)
    if ROTATE:
        pos = tl.load(Positions + i).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + offs, mask=mask)
        sin = tl.load(CosSin + pos * stride_cs + HALF + offs, mask=mask)
        k1f = k1.to(tl.float32)
        k2f = k2.to(tl.float32)
        if HEAD_NORM:
            inv = tl.math.rsqrt((tl.sum(k1f * k1f, axis=0) + tl.sum(k2f * k2f, axis=0)) / (2 * HALF) + norm_eps)
            k1f = _head_normed(k1f, inv, tl.load(KNormW + offs, mask=mask, other=0.0).to(tl.float32), K.dtype.element_ty)
            k2f = _head_normed(k2f, inv, tl.load(KNormW + HALF + offs, mask=mask, other=0.0).to(tl.float32),
                               K.dtype.element_ty)
        r1, r2 = _rotate_halves(k1f, k2f, cos, sin)
        tl.store(k_row + offs, r1.to(K.dtype.element_ty), mask=mask)
        tl.store(k_row + HALF + offs, r2.to(K.dtype.element_ty), mask=mask)
        tl.store(kb_row + offs, _to_pool(r1, k_scale, kb_ty, FMAX, QUANT), mask=mask)
        tl.store(kb_row + HALF + offs, _to_pool(r2, k_scale, kb_ty, FMAX, QUANT), mask=mask)
        heads = h * GROUP + tl.arange(0, BLOCK_G)
        mask_q = (tl.arange(0, BLOCK_G) < GROUP)[:, None] & mask[None, :]
        q_rows = Q + i * stride_qn + heads[:, None] * stride_qh + offs[None, :]
        q1 = tl.load(q_rows, mask=mask_q, other=0.0).to(tl.float32)
        q2 = tl.load(q_rows + HALF, mask=mask_q, other=0.0).to(tl.float32)
        if HEAD_NORM:
            inv = tl.math.rsqrt((tl.sum(q1 * q1, axis=1) + tl.sum(q2 * q2, axis=1)) / (2 * HALF) + norm_eps)[:, None]
            q1 = _head_normed(q1, inv, tl.load(QNormW + offs, mask=mask, other=0.0).to(tl.float32)[None, :],
                              Q.dtype.element_ty)
            q2 = _head_normed(q2, inv, tl.load(QNormW + HALF + offs, mask=mask, other=0.0).to(tl.float32)[None, :],
                              Q.dtype.element_ty)
        r1, r2 = _rotate_halves(q1, q2, cos[None, :], sin[None, :])
        out_rows = QOut + i * stride_qon + heads[:, None] * stride_qoh + offs[None, :]
        tl.store(out_rows, r1.to(QOut.dtype.element_ty), mask=mask_q)
        tl.store(out_rows + HALF, r2.to(QOut.dtype.element_ty), mask=mask_q)
    else:
        tl.store(kb_row + offs, _to_pool(k1, k_scale, kb_ty, FMAX, QUANT), mask=mask)
        tl.store(kb_row + HALF + offs, _to_pool(k2, k_scale, kb_ty, FMAX, QUANT), mask=mask)
    v1 = tl.load(v_row + offs, mask=mask)
    v2 = tl.load(v_row + HALF + offs, mask=mask)
    tl.store(vb_row + offs, _to_pool(v1, v_scale, vb_ty, FMAX, QUANT), mask=mask)
    tl.store(vb_row + HALF + offs, _to_pool(v2, v_scale, vb_ty, FMAX, QUANT), mask=mask)


def _launch(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    head_norm: HeadNorm | None = None,
) -> None:
    """`rope` is (q, q_out, positions, cos_sin), or None to store without rotating; `scales` the
    layer's (k_scale, v_scale), read only by an FP8 pool (which needs both); `head_norm` (with `rope`
    only) the per-head norms applied before rotating."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    quant = is_fp8(k_buf.dtype)
    k_scale, v_scale = scales
    if quant:
        assert k_scale is not None and v_scale is not None, "an FP8 pool needs the layer's k_scale and v_scale"
        assert v_buf.dtype == k_buf.dtype
    else:  # never read
        k_scale = v_scale = k
    # Without rotation the q / positions / table arguments are never read: any tensor will do.
    q, q_out, positions, cos_sin = rope if rope is not None else (k, k, loc, k)
    for t in (k, v, k_buf, v_buf, q, q_out, cos_sin):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    if head_norm is not None:
        assert rope is not None, "head norms are fused with the rotation only"
        norm_w = (head_norm.q_weight, head_norm.k_weight)
        assert all(w.shape == (head_dim,) and w.is_contiguous() for w in norm_w), "head norm weights: [head_dim]"
    else:  # never read
        norm_w = (k, k)
    group = q.shape[1] // kv_heads
    elems = (group + 2) * head_dim
    pdl = use_pdl(k)
    _store_kv_kernel[(n, kv_heads)](
        q, q_out, k, v, k_buf, v_buf, loc, positions, cos_sin, k_scale, v_scale, *norm_w,
        head_norm.eps if head_norm is not None else 0.0,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        cos_sin.stride(0),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), ROTATE=rope is not None,
        QUANT=quant, FMAX=torch.finfo(k_buf.dtype).max if quant else 0.0, HEAD_NORM=head_norm is not None, PDL=pdl,
        num_warps=1 if elems <= 512 else 2 if elems <= 2048 else 4, launch_pdl=pdl,
    )


def store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """k_buf[loc[i]] = k[i] and v_buf[loc[i]] = v[i] for every i (k, v: [n, kv_heads, head_dim]), quantized
    with the scales in an FP8 pool."""
    _launch(k_buf, v_buf, loc, k, v, None, (k_scale, v_scale))


def rope_store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, q_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, head_norm: HeadNorm | None = None,
) -> torch.Tensor:
    """Rotate q [n, heads, head_dim] and k [n, kv_heads, head_dim] by `positions` with the float32
    table `cos_sin` [max_position, head_dim] (cos | sin halves), store the rotated k and v at `loc`,
    and return the rotated q: written to `q_out` when given (e.g. a contiguous buffer), else in place.
    k is rotated in place either way. An FP8 pool stores k and v quantized with the scales. With
    `head_norm`, q and k heads are RMS-normalised first (the module docstring's "Head norms")."""
    q_out = q if q_out is None else q_out
    assert q.shape[1] % k.shape[1] == 0, f"{q.shape[1]} query heads for {k.shape[1]} kv heads"
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[-1] == k.shape[-1], "cos_sin: float32 [positions, head_dim]"
    _launch(k_buf, v_buf, loc, k, v, (q, q_out, positions, cos_sin), (k_scale, v_scale), head_norm)
    return q_out
