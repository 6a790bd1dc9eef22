"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm transformer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, normalised in float32 and cast back to the input dtype before the
    weight multiply (the order Hugging Face Llama uses, so half-precision outputs agree bit for bit
    in the common case).

    With a `residual`, computes `x + residual` first (in the input dtype) and returns
    `(normed, x + residual)`: the sum is the residual stream the next block adds onto.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
