"""What the builtin methods share: which layers they take over, and turning a layer dense again.

A method takes over the tensor-parallel linear layers (`_TPLinear`: dense, column / row parallel,
fused qkv and gate_up) whose name its checkpoint does not list as left unquantized. Checkpoints
name the projections as they store them (`q_proj`), rxf's fused layers hold several
(`qkv_proj`): a fused layer is left dense when any of its projections is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rxf.core.quantization import QuantizationMethod
from rxf.plugins.models.layers.linear import DENSE, _TPLinear
from rxf.plugins.models.layers.moe import FusedExperts

# rxf's fused projections and the checkpoint projections each holds.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_names(name: str) -> list[str]:
    """The checkpoint's names for rxf's layer `name` (its projections', for a fused one)."""
    head, _, last = name.rpartition(".")
    parts = FUSED_PARTS.get(last)
    if parts is None:
        return [name]
    return [f"{head}.{p}" if head else p for p in parts]


def name_matches(pattern: str, name: str) -> bool:
    """compressed-tensors' rule: `re:` + a regular expression matched against the whole name;
    otherwise the name itself or a dotted prefix or suffix of it (`lm_head`, `model.layers.0.mlp.gate`,
    `visual`)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)


class LinearMethod(QuantizationMethod):
    """A method for the linear layers; `skipped` lists the checkpoint's names left unquantized."""

    skipped: tuple[str, ...] = ()

    def quantizes(self, module: nn.Module, name: str) -> bool:
        names = checkpoint_names(name)
        if any(name_matches(p, n) for p in self.skipped for n in names):
            return False
        if isinstance(module, FusedExperts):
            return self.quantizes_experts(name)
        if not isinstance(module, _TPLinear):
            return False
        # The layer's role (`qkv_proj`, `down_proj`, ...) picks its decode-GEMV settings (`qgemv.py`):
        # a layer does not know its own name, and this is where the method first sees it.
        module.gemv_role = name.rpartition(".")[2]
        return True

    def apply_activated(
        self, layer: nn.Module, x: torch.Tensor, act: nn.Module, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """A layer whose method gave it a decode GEMV (`layer.qgemv`: the FP8 and int4 builtins) takes the
        SiLU·mul after it into the GEMV's launch at batch 1 (`QuantGemv.activated`), unless it permutes its
        input (act-order int4)."""
        from rxf.plugins.quantization.qgemv import QuantGemv

        gemv = getattr(layer, "qgemv", None)
        if not isinstance(gemv, QuantGemv) or getattr(layer, "input_order", None) is not None or not gemv.takes(x):
            return None
        return gemv.activated(x, bias, act)

    def quantizes_experts(self, name: str) -> bool:
        """Whether the method takes over the MoE experts `name` (a method without an expert
        layout refuses them, naming itself)."""
        raise NotImplementedError(
            f"{self.name}: quantized MoE experts ({name}) are not supported yet; the experts of a "
            f"{self.name} checkpoint cannot load (its dense layers would)"
        )


def config_value(quant_config: dict[str, Any], key: str, allowed: Iterable[Any], method: str) -> Any:
    """`quant_config[key]`, refused with the key, the value and what is supported unless in `allowed`."""
    allowed = tuple(allowed)
    value = quant_config.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"{method}: quantization_config.{key} = {value!r} is not supported (supported: "
                         f"{', '.join(map(repr, allowed))})")
    return value


def become_dense(layer: _TPLinear, weight: torch.Tensor, quant_params: Iterable[str]) -> None:
    """Make `layer` a plain dense layer with `weight` `[out, in]` (a quantized layer dequantized on a
    device without its kernels): the method's parameters go, the dense matmul path serves it."""
    for name in quant_params:
        delattr(layer, name)
    layer.quant = None
    layer.add_param("weight", weight.to(layer.dtype).contiguous(), DENSE)
