"""Int4 weight-only layers (AWQ, GPTQ): unpacking their int32 words, and one form to compute with.

Both formats store 4-bit codes eight to an int32 word, bits [4i, 4i + 4) holding the i-th code of
the word in the format's order, with per-group `scales` and zero points: `w[k, n] = (q[k, n] -
z[g(k), n]) * s[g(k), n]`, k an input feature, n an output feature, g(k) its group. A format's
method unpacks its tensors into `Int4Weights` (codes `[K, N]`, zeros and scales `[G, N]`, the group
of each input feature `[K]`); then on CUDA the codes are packed again, eight consecutive input
features to a word (`[K / 8, N]`), with input features sorted by group so that each group is a run
of `group_size` rows (act-order GPTQ: the layer then permutes its input's columns the same way),
for the dequantizing Triton GEMM of `int4_kernel.py` and, for decode batches of at most 8 rows, the
int4 GEMV of `qgemv.py`; on the CPU the same sorted codes are packed for torch's int4 matmul
(`cpu_packing.py`, activations in bf16); where neither serves a layer its weight is dequantized at
load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rxf.plugins.quantization import cpu_packing, qgemv
from rxf.plugins.quantization.base import LinearMethod, become_dense, config_value

SEQUENTIAL = tuple(range(8))


def unpack_int32(packed: torch.Tensor, dim: int, order: Sequence[int] = SEQUENTIAL) -> torch.Tensor:
    """int32 words -> their eight 4-bit codes (uint8), eight times as long along `dim`; code j of a
    word (the j-th feature it covers) sits in nibble `order[j]`."""
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int32, device=packed.device)
    p = packed.movedim(dim, -1).unsqueeze(-1)
    codes = ((p >> shifts) & 0xF).to(torch.uint8).flatten(-2)
    return codes.movedim(-1, dim).contiguous()


def pack_int32(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight consecutive codes along `dim` to an int32 word, code j in nibble j (rxf's GPU layout)."""
    c = codes.to(torch.int32).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.int32).movedim(-1, dim).contiguous()


@dataclass
class Int4Weights:
    codes: torch.Tensor  # uint8 [K, N]
    zeros: torch.Tensor  # [G, N], in the codes' units (float)
    scales: torch.Tensor  # [G, N]
    group_of: torch.Tensor  # int64 [K]: the group of each input feature

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense `[N, K]` weight."""
        g = self.group_of
        w = (self.codes.float() - self.zeros.float()[g]) * self.scales.float()[g]
        return w.t().to(dtype)

    def group_runs(self, group_size: int) -> tuple[torch.Tensor, slice] | None:
        """(the input order that makes each group a run of `group_size` inputs, the groups used), or
        None when sorting by group does not give such runs (act order split by tensor parallelism)."""
        order = torch.argsort(self.group_of, stable=True)
        sorted_groups = self.group_of[order]
        runs = torch.arange(len(order), device=order.device) // group_size
        if not torch.equal(sorted_groups - sorted_groups[0], runs):
            return None
        first = int(sorted_groups[0])
        return order, slice(first, first + int(runs[-1]) + 1)


class Int4Method(LinearMethod):
    """A format's layers: `create_weights` registers its tensors and sets `layer.group_size`,
    `unpack(layer)` reads them."""

    quant_params: tuple[str, ...] = ()

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        found = None if quant_config is None else quant_config.get("quant_method")
        if found != self.name:
            raise ValueError(f"{self.name} loads {self.name} checkpoints only (it cannot quantize at load); this "
                             f"checkpoint's quant_method is {found!r}")
        config_value(quant_config, "bits", (4,), self.name)

    def unpack(self, layer: nn.Module) -> Int4Weights:
        raise NotImplementedError

    def process_loaded(self, layer: nn.Module) -> None:
        weights = self.unpack(layer)
        cuda = layer.qweight.is_cuda
        kernel_group = None if cuda else cpu_packing.int4_kernel_group(
            layer.out_per_rank, layer.in_per_rank, layer.group_size)
        runs = weights.group_runs(layer.group_size) if cuda or kernel_group else None
        if runs is None:  # no kernel here, or groups that are not runs (act order split by tp)
            become_dense(layer, weights.dequantize(layer.dtype), self.quant_params)
            return
        order, used = runs
        for name in self.quant_params:
            delattr(layer, name)
        codes, scales, zeros = weights.codes[order], weights.scales[used], weights.zeros[used]
        layer.qgemv = None
        if cuda:
            layer.add_param("qweight", pack_int32(codes, dim=0))
            layer.add_param("scales", scales.to(layer.dtype).contiguous())
            layer.add_param("zeros", zeros.to(layer.dtype).contiguous())
            layer.qgemv = qgemv.int4(layer, layer.group_size)
        else:
            table = cpu_packing.int4_scales_and_zeros(scales, zeros, layer.group_size, kernel_group)
            cpu_packing.set_packed_int4(layer, codes.t(), table, kernel_group)
        identity = torch.equal(order, torch.arange(len(order), device=order.device))
        layer.input_order = None if identity else order

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.input_order is not None:
            x = x.index_select(-1, layer.input_order)
        if not x.is_cuda:
            return cpu_packing.packed_int4_linear(layer, x, bias)
        if layer.qgemv is not None and layer.qgemv.takes(x):  # decode batches: the int4 GEMV
            return layer.qgemv(x, bias)
        from rxf.plugins.quantization.int4_kernel import int4_linear

        return int4_linear(x, layer.qweight, layer.scales, layer.zeros, layer.group_size, bias)
