"""RMSNorm (Llama's and Gemma's), optionally fused with the residual add that precedes it in a
pre-norm transformer."""

from __future__ import annotations

import torch
from torch import nn

from rxf.core.runner.pdl import use_pdl
from rxf.plugins.models.layers.fused_kernels import flashinfer_for

# Rows (decode batches) that take rxf's own norm kernel where the GPU has programmatic dependent
# launch (`rmsnorm_kernel.py`: it lets the projection after it start early); larger batches and
# older GPUs keep FlashInfer's.
PDL_ROWS = 16
PDL_MAX_HIDDEN = 16384  # the kernel holds a row in one program's registers


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, normalised in float32 and cast back to the input dtype before the
    weight multiply (the order Hugging Face Llama uses, so half-precision outputs agree bit for bit
    in the common case).

    With a `residual`, computes `x + residual` first (in the input dtype) and returns
    `(normed, x + residual)`: the sum is the residual stream the next block adds onto.

    On CUDA in fp16/bf16 with flashinfer, one fused kernel does it (float32 inside, one rounding at
    the end, so results differ from `forward_native` by bf16 rounding only). That path works in place:
    with a residual, `x` is overwritten by the normed output and `residual` by the sum, so callers
    hand both over and keep only the returned tensors.
    """

    # flashinfer.norm's kernels for this norm: alone, and fused with the residual add.
    fused_kernels = ("rmsnorm", "fused_add_rmsnorm")
    gemma = False  # rmsnorm_kernel's variant

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normalized(x).to(x.dtype)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._decode_kernel_applies(x, residual):
            from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps, gemma=self.gemma)
            rmsnorm(x, self.weight, self.eps, residual, gemma=self.gemma, out=x)  # in place, as FlashInfer's
            return x, residual
        fi = flashinfer_for(x)
        if fi is None or x.dim() != 2 or not x.is_contiguous():
            return self.forward_native(x, residual)
        alone, with_add = (getattr(fi.norm, name) for name in self.fused_kernels)
        if residual is None:
            return alone(x, self.weight, self.eps)
        if not residual.is_contiguous() or residual.dtype != x.dtype:
            return self.forward_native(x, residual)
        with_add(x, residual, self.weight, self.eps)  # residual += x; x = norm(residual)
        return x, residual

    @staticmethod
    def _decode_kernel_applies(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        # The device first: a size test is a guard in a CPU forward compiled whole (a row bound there
        # would send larger batches to eager).
        return (x.is_cuda and x.dim() == 2 and x.shape[0] <= PDL_ROWS and x.shape[1] <= PDL_MAX_HIDDEN
                and x.is_contiguous()
                and x.dtype in (torch.float16, torch.bfloat16) and use_pdl(x)
                and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)))


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x / rms(x) * (1 + weight)`, all of it in float32 and cast back to the input
    dtype once at the end (Hugging Face Gemma's order: it differs from Llama's, which casts before
    the weight multiply). Checkpoints store `weight` around 0, not 1.

    The residual variant and the in-place contract of the fused CUDA path are `RMSNorm`'s
    (flashinfer's gemma_rmsnorm / gemma_fused_add_rmsnorm add the 1 themselves).
    """

    fused_kernels = ("gemma_rmsnorm", "gemma_fused_add_rmsnorm")
    gemma = True

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normalized(x) * (1.0 + self.weight.float())).to(x.dtype)
