"""The decode RMSNorm kernel's numerics (`layers/rmsnorm_kernel.py`, FlashInfer's), in torch: what the
kernel's tests compare it with."""

from __future__ import annotations

import torch


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, the new residual or None): `s = x + residual` in float32, the residual stored
    rounded to x's dtype, and `s * rsqrt(mean(s^2) + eps) * w` (Gemma: `1 + w`) of the unrounded
    `s` in float32, rounded once."""
    s = x.float() if residual is None else x.float() + residual.float()
    w = weight.float() + 1.0 if gemma else weight.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w
    return normed.to(x.dtype), None if residual is None else s.to(x.dtype)
