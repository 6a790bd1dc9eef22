"""`int8`, `int4`, `int4-g64`, `int4-g128`: weight-only integer quantization of an unquantized
checkpoint at load, for the CPU's packed matmuls (`cpu_packing.py`).

  `int8`: symmetric per output row, `w = q * s`, q in [-127, 127], s = the row's absmax / 127.
  `int4`, `int4-g64`, `int4-g128`: asymmetric per row and group of 32 (llama.cpp Q4's block), 64
      or 128 inputs, in the form torch's int4 op computes: `w = (q - 8) * s + m`, q in [0, 15],
      s = (max - min) / 15 and m = min + 8 s of the group; a layer whose inputs do not divide into
      the groups is refused at start-up, naming it.

Scales (and the int4 offsets m) are rounded to bf16, the precision the packed ops read them in, and
the codes are chosen against the rounded values, so the dequantized weight (`RXF_CPU_WEIGHT_PACKING=0`,
or a layer the ops cannot take, or CUDA, where these methods dequantize at load) is exactly what the
packed path multiplies by. The dense weight loads as usual and is quantized in `process_loaded`;
MoE experts stay in the model's dtype; the logits head is int8 per row for every one of them
(`Int8Head`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rxf.core.quantization import QuantizationMethod
from rxf.plugins.quantization import cpu_packing
from rxf.plugins.quantization.base import LinearMethod, become_dense

_SCALE = cpu_packing.COMPUTE_DTYPE


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 `q`, bf16 scale per row) of `w` `[N, K]`: `w ~ q * scale`, q in [-127, 127]."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(_SCALE)
    return torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Head(QuantizationMethod):
    """The logits head in int8 per row for `_weight_int8pack_mm`, quantized from its loaded weight,
    which stays (the embedding may share it). The op's logits are bf16: 8 bits of mantissa, so
    logits of 25.33 and 25.24 (the demo's first answer token, "The" against "L") both round to 25.25.
    The `RESCORED` highest of each row are therefore computed again from the dense weight in the
    model's dtype: the tokens greedy decoding and the top of a sampling distribution choose between
    get the dense head's logits, the rest the int8 estimate (within 0.7 of them on the demo,
    measured). Where the op cannot serve it the head stays dense."""

    name = "int8-head"
    RESCORED = 16

    def process_loaded(self, head: nn.Module) -> None:
        w = head.weight.data
        if w.is_cuda or not cpu_packing.int8_fits(w.shape[1]):
            head.quant = None
            return
        q, scale = quantize_int8_rows(w)
        head.register_buffer("weight_int8", q, persistent=False)
        head.register_buffer("weight_scale", scale, persistent=False)

    def apply(self, head: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        logits = cpu_packing.int8_linear(x, head.weight_int8, head.weight_scale, bias).float()
        top = logits.topk(min(self.RESCORED, logits.shape[-1]), dim=-1).indices
        exact = torch.einsum("...k,...jk->...j", x, head.weight[top]).float()
        return logits.scatter_(-1, top, exact)


class OnlineIntMethod(LinearMethod):
    """What the online integer methods share: unquantized checkpoints only, the dense weight
    loaded as usual and quantized after; the logits head in int8 per row (`Int8Head`: llama.cpp's
    4-bit files keep their output layer in 6 or 8 bits too)."""

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        if quant_config is not None:
            raise ValueError(f"model.quantization {self.name!r} quantizes an unquantized checkpoint at load; this "
                             f"checkpoint is quantized with {quant_config.get('quant_method')!r} (leave "
                             "model.quantization unset to load it as it is)")

    def create_weights(self, layer: nn.Module) -> None:
        layer.create_dense_weight()

    def quantizes_experts(self, name: str) -> bool:
        return False  # MoE experts stay in the model's dtype

    def after_load(self, module: nn.Module, name: str) -> QuantizationMethod | None:
        return Int8Head(None, self.dtype)


class OnlineInt8Method(OnlineIntMethod):
    name = "int8"

    def process_loaded(self, layer: nn.Module) -> None:
        q, scale = quantize_int8_rows(layer.weight.data)
        if layer.weight.is_cuda or not cpu_packing.int8_fits(layer.in_per_rank):
            become_dense(layer, q.float() * scale.float()[:, None], ("weight",))
            return
        del layer.weight
        layer.add_param("weight_int8", q)
        layer.add_param("weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_packing.int8_linear(x, layer.weight_int8, layer.weight_scale, bias)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 `[N, K]`, scales and offsets bf16 `[K / group, N]`) of `w` `[N, K]` in the form
    `w ~ (q - 8) * s + m` (see the module docstring)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10).to(_SCALE)
    offset = (lo + 8 * scale.float()).to(_SCALE)
    q = torch.round((wg - offset.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scale.t().contiguous(), offset.t().contiguous()


class OnlineInt4Method(OnlineIntMethod):
    name = "int4"
    group_size = 32

    def quantizes(self, module: nn.Module, name: str) -> bool:
        taken = super().quantizes(module, name)
        if taken and module.in_per_rank % self.group_size:
            raise ValueError(f"model.quantization {self.name!r}: {name} has {module.in_per_rank} inputs, not a multiple "
                             f"of the group size {self.group_size}; choose a smaller group (int4: 32)")
        return taken

    def process_loaded(self, layer: nn.Module) -> None:
        g = self.group_size
        codes, scale, offset = quantize_int4(layer.weight.data, g)
        kernel_group = None if layer.weight.is_cuda else cpu_packing.int4_kernel_group(layer.out_per_rank, layer.in_per_rank, g)
        if kernel_group is None:
            dense = (codes.float() - 8) * scale.float().t().repeat_interleave(g, 1) + offset.float().t().repeat_interleave(g, 1)
            become_dense(layer, dense, ("weight",))
            return
        del layer.weight
        cpu_packing.set_packed_int4(layer, codes, torch.stack([scale, offset], dim=-1), kernel_group)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_packing.packed_int4_linear(layer, x, bias)


class OnlineInt4G64Method(OnlineInt4Method):
    name = "int4-g64"
    group_size = 64


class OnlineInt4G128Method(OnlineInt4Method):
    name = "int4-g128"
    group_size = 128
