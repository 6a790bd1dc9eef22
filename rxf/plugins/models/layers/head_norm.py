"""Per-head RMSNorm of the queries and keys inside a fused qkv projection's output (Qwen3's
`q_norm` / `k_norm`): each head vector of `head_dim` values is normalised on its own, with one
weight vector shared by all query heads and another by all key heads; values are untouched.

`norm_heads_(qkv, ...)` works in place on the `[tokens, (heads + 2 * kv_heads) * head_dim]` output.
On CUDA it is one Triton launch for q and k together (`head_norm_kernel.py`, imported on first use:
plugins load no kernel library at import); elsewhere the two `RMSNorm` modules' torch code, which
is also the kernel's reference. At batch-1 decode this replaces a dozen small kernels per layer
(copies out of the strided views, the norm's elementwise steps) with one.

A backend that fuses the rotation into its K/V store and says `fuses_head_norm` (triton, flashinfer)
takes the norms into that same launch instead: the layer hands it a `HeadNormedRotary`, whose
`head_norm` the kernel applies before rotating, and no separate launch runs.
"""

from __future__ import annotations

import torch

from rxf.core.attention import HeadNorm, Rotary
from rxf.plugins.models.layers.norm import RMSNorm


def norm_heads_(
    qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """Normalise the q heads (columns `[0, num_heads * head_dim)`) with `q_norm` and the k heads
    after them with `k_norm`, in place; the rounding is RMSNorm's (float32 inside, cast to the input
    dtype before the weight multiply)."""
    if q_norm.eps != k_norm.eps:
        raise ValueError(f"q_norm eps {q_norm.eps} != k_norm eps {k_norm.eps}")
    if qkv.is_cuda and qkv.stride(-1) == 1:
        from rxf.plugins.models.layers.head_norm_kernel import norm_heads_cuda_

        norm_heads_cuda_(qkv, q_norm.weight, k_norm.weight, num_heads, num_kv_heads, head_dim, q_norm.eps)
        return
    q_cols, k_cols = num_heads * head_dim, num_kv_heads * head_dim
    for norm, start, cols in ((q_norm, 0, q_cols), (k_norm, q_cols, k_cols)):
        heads = qkv[:, start : start + cols].unflatten(-1, (-1, head_dim))
        heads.copy_(norm.forward_native(heads))


class HeadNormedRotary:
    """A layer's rotary embedding preceded by its per-head q / k norms: `head_norm` for a backend that
    fuses both into its K/V store; called, it normalises then rotates (the `Rotary` contract).
    The norms' weights are read when used, so loading or moving the model needs nothing here."""

    def __init__(self, rotary: Rotary, q_norm: RMSNorm, k_norm: RMSNorm, head_dim: int) -> None:
        if q_norm.eps != k_norm.eps:
            raise ValueError(f"q_norm eps {q_norm.eps} != k_norm eps {k_norm.eps}")
        self.rotary, self.q_norm, self.k_norm, self.head_dim = rotary, q_norm, k_norm, head_dim

    @property
    def cos_sin_cache(self) -> torch.Tensor | None:
        return self.rotary.cos_sin_cache

    @property
    def head_norm(self) -> HeadNorm:
        return HeadNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_norm.forward_native(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k = self.k_norm.forward_native(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return self.rotary(positions, q, k)
