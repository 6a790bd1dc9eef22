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

Rotation (NeoX rotate-half over the whole head, as `RotaryEmbedding`): with x1, x2 the halves of a
head and c, s the cos | sin halves of `cos_sin[positions[i]]` (float32), x -> (x1 c - x2 s, x2 c + x1 s),
computed in float32 and rounded once to each destination's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_halves(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_kv_kernel(
    Q, QOut, K, V, KBuf, VBuf, Loc, Positions, CosSin,
    stride_qn, stride_qh, stride_qon, stride_qoh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_cs,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(Loc + i).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    k_row = K + i * stride_kn + h * stride_kh
    v_row = V + i * stride_vn + h * stride_vh
    kb_row = KBuf + slot * stride_kbs + h * stride_kbh
    vb_row = VBuf + slot * stride_vbs + h * stride_vbh
    k1 = tl.load(k_row + offs, mask=mask)
    k2 = tl.load(k_row + HALF + offs, mask=mask)
    if ROTATE:
        pos = tl.load(Positions + i).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + offs, mask=mask)
        sin = tl.load(CosSin + pos * stride_cs + HALF + offs, mask=mask)
        r1, r2 = _rotate_halves(k1.to(tl.float32), k2.to(tl.float32), cos, sin)
        tl.store(k_row + offs, r1.to(K.dtype.element_ty), mask=mask)
        tl.store(k_row + HALF + offs, r2.to(K.dtype.element_ty), mask=mask)
        tl.store(kb_row + offs, r1.to(KBuf.dtype.element_ty), mask=mask)
        tl.store(kb_row + HALF + offs, r2.to(KBuf.dtype.element_ty), mask=mask)
        heads = h * GROUP + tl.arange(0, BLOCK_G)
        mask_q = (tl.arange(0, BLOCK_G) < GROUP)[:, None] & mask[None, :]
        q_rows = Q + i * stride_qn + heads[:, None] * stride_qh + offs[None, :]
        q1 = tl.load(q_rows, mask=mask_q).to(tl.float32)
        q2 = tl.load(q_rows + HALF, mask=mask_q).to(tl.float32)
        r1, r2 = _rotate_halves(q1, q2, cos[None, :], sin[None, :])
        out_rows = QOut + i * stride_qon + heads[:, None] * stride_qoh + offs[None, :]
        tl.store(out_rows, r1.to(QOut.dtype.element_ty), mask=mask_q)
        tl.store(out_rows + HALF, r2.to(QOut.dtype.element_ty), mask=mask_q)
    else:
        tl.store(kb_row + offs, k1.to(KBuf.dtype.element_ty), mask=mask)
        tl.store(kb_row + HALF + offs, k2.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(vb_row + offs, tl.load(v_row + offs, mask=mask).to(VBuf.dtype.element_ty), mask=mask)
    tl.store(vb_row + HALF + offs, tl.load(v_row + HALF + offs, mask=mask).to(VBuf.dtype.element_ty), mask=mask)


def _launch(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """`rope` is (q, q_out, positions, cos_sin), or None to store without rotating."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    # Without rotation the q / positions / table arguments are never read: any tensor will do.
    q, q_out, positions, cos_sin = rope if rope is not None else (k, k, loc, k)
    for t in (k, v, k_buf, v_buf, q, q_out, cos_sin):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    group = q.shape[1] // kv_heads
    elems = (group + 2) * head_dim
    _store_kv_kernel[(n, kv_heads)](
        q, q_out, k, v, k_buf, v_buf, loc, positions, cos_sin,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        cos_sin.stride(0),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), ROTATE=rope is not None,
        num_warps=1 if elems <= 512 else 2 if elems <= 2048 else 4,
    )


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buf[loc[i]] = k[i] and v_buf[loc[i]] = v[i] for every i (k, v: [n, kv_heads, head_dim])."""
    _launch(k_buf, v_buf, loc, k, v, None)


def rope_store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [n, heads, head_dim] and k [n, kv_heads, head_dim] by `positions` with the float32
    table `cos_sin` [max_position, head_dim] (cos | sin halves), store the rotated k and v at `loc`,
    and return the rotated q: written to `q_out` when given (e.g. a contiguous buffer), else in place.
    k is rotated in place either way."""
    q_out = q if q_out is None else q_out
    assert q.shape[1] % k.shape[1] == 0, f"{q.shape[1]} query heads for {k.shape[1]} kv heads"
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[-1] == k.shape[-1], "cos_sin: float32 [positions, head_dim]"
    _launch(k_buf, v_buf, loc, k, v, (q, q_out, positions, cos_sin))
    return q_out
