"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rxf.plugins.models.layers.fused_kernels import flashinfer_for


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the last dimension of the input is `[gate | up]` (equal halves).

    On CUDA in fp16/bf16 with flashinfer, one fused kernel (float32 inside, one rounding) instead of
    three elementwise passes over the `[n, 2 * intermediate]` activation.
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fi = flashinfer_for(x)
        if fi is None or not x.is_contiguous():
            return self.forward_native(x)
        return fi.activation.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """`gelu_tanh(gate) * up` over `[gate | up]` (Gemma's `gelu_pytorch_tanh` GLU); on CUDA in
    fp16/bf16 with flashinfer, one fused kernel, as `SiluAndMul`."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fi = flashinfer_for(x)
        if fi is None or not x.is_contiguous():
            return self.forward_native(x)
        return fi.activation.gelu_tanh_and_mul(x)
