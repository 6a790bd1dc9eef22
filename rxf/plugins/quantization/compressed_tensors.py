"""`compressed-tensors`: llm-compressor's FP8 checkpoints ("FP8-dynamic", "FP8").

`quantization_config` (format `float-quantized` or `naive-quantized`): `config_groups` whose
`targets` include `Linear`, each with `weights` `{num_bits: 8, type: float, strategy: channel |
tensor, symmetric: true}` and `input_activations` `{dynamic: true, strategy: token}` (dynamic per
token), `{dynamic: false, strategy: tensor}` (a static scale per layer) or null (weight-only), and an
`ignore` list (`lm_head`, `re:` expressions). A quantized projection stores `weight`
(float8_e4m3fn `[N, K]`), `weight_scale` (`[N, 1]` per channel, one value per tensor) and, static,
`input_scale` (one value).

Fused projections (qkv, gate_up) hold one scale per row: per-tensor scales are spread over their
projection's rows at load, and a static input scale is the largest of the projections' (every
projection's activations then fit it). Int4 / int8 "pack-quantized" and "int-quantized" formats,
group and block strategies are refused at start-up. MoE experts: see `fp8_experts` (weight-only
FP8 in the fused MoE kernels).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rxf.plugins.models.layers.linear import TensorLayout
from rxf.plugins.models.layers.moe import FusedExperts
from rxf.plugins.quantization import fp8_experts, fp8_ops, qgemv
from rxf.plugins.quantization.base import LinearMethod, become_dense, config_value
from rxf.plugins.quantization.fp8_experts import SCALE_DTYPES as _SCALE_DTYPES

_NAME = "compressed-tensors"


def _linear_scheme(quant_config: dict[str, Any]) -> dict[str, Any]:
    groups = [g for g in (quant_config.get("config_groups") or {}).values() if "Linear" in (g.get("targets") or ())]
    if len(groups) != 1:
        raise ValueError(f"{_NAME}: expected one config group targeting Linear, found {len(groups)} "
                         "(per-layer schemes are not supported)")
    return groups[0]


class CompressedTensorsMethod(LinearMethod):
    name = _NAME

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        if quant_config is None or quant_config.get("quant_method") != _NAME:
            found = None if quant_config is None else quant_config.get("quant_method")
            raise ValueError(f"{_NAME} loads checkpoints quantized with llm-compressor; this one's quant_method "
                             f"is {found!r}")
        config_value(quant_config, "format", ("float-quantized", "naive-quantized"), _NAME)
        scheme = _linear_scheme(quant_config)
        weights = scheme.get("weights") or {}
        for key, allowed in (("num_bits", (8,)), ("type", ("float",)), ("symmetric", (True,))):
            config_value(weights, key, allowed, f"{_NAME} weights")
        self.per_channel = config_value(weights, "strategy", ("channel", "tensor"), f"{_NAME} weights") == "channel"
        acts = scheme.get("input_activations")
        self.static_input = False
        if acts is not None:
            config_value(acts, "num_bits", (8,), f"{_NAME} input_activations")
            config_value(acts, "type", ("float",), f"{_NAME} input_activations")
            self.static_input = not acts.get("dynamic", False)
            config_value(acts, "strategy", ("tensor",) if self.static_input else ("token",), f"{_NAME} input_activations")
        self.weight_only = acts is None
        self.skipped = tuple(quant_config.get("ignore") or ())

    def quantizes_experts(self, name: str) -> bool:
        return True

    def create_weights(self, layer: nn.Module) -> None:
        if isinstance(layer, FusedExperts):
            fp8_experts.create_rows(layer, self.per_channel, self.static_input)
            return
        n, k = layer.out_per_rank, layer.in_per_rank
        shards = len(getattr(layer, "shard_ids", (None,)))
        layer.add_param("weight", torch.empty(n, k, dtype=fp8_ops.FP8), TensorLayout(dtypes=(fp8_ops.FP8,)))
        if self.per_channel:
            layer.add_param("weight_scale", torch.empty(n, 1), TensorLayout(in_dim=None, dtypes=_SCALE_DTYPES))
        else:
            layer.add_param("weight_scale", torch.empty(shards), TensorLayout(per_shard=True, dtypes=_SCALE_DTYPES))
        if self.static_input:
            layer.add_param("input_scale", torch.empty(shards), TensorLayout(per_shard=True, dtypes=_SCALE_DTYPES))

    def process_loaded(self, layer: nn.Module) -> None:
        if isinstance(layer, FusedExperts):
            fp8_experts.process_rows(layer)
            return
        scale = layer.weight_scale.data.float()
        if not self.per_channel:  # each projection's scale over its rows
            sizes = getattr(layer, "shard_sizes", [layer.out_per_rank])
            scale = scale.repeat_interleave(torch.tensor(sizes, device=scale.device))
        scale = scale.reshape(-1)
        names = ("weight", "weight_scale", "input_scale") if self.static_input else ("weight", "weight_scale")
        if not layer.weight.is_cuda:
            become_dense(layer, fp8_ops.dequantize_rows(layer.weight.data, scale, layer.dtype), names)
            return
        layer.add_param("weight_scale", scale.contiguous())
        if self.static_input:
            layer.add_param("input_scale", layer.input_scale.data.float().max().reshape(()))
        layer.qgemv = qgemv.fp8_rows(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.qgemv is not None and layer.qgemv.takes(x):  # decode batches: weight-only FP8 GEMV
            return layer.qgemv(x, bias)
        if self.weight_only:  # W8A16: the weight dequantized per call (no FP8 GEMM takes half inputs)
            return torch.nn.functional.linear(x, fp8_ops.dequantize_rows(layer.weight, layer.weight_scale, x.dtype), bias)
        return fp8_ops.scaled_mm_rows(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None), bias)

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, act: nn.Module, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if self.weight_only or self.static_input or not fp8_ops.quantizes_gated(layer, x, act):
            return None
        return fp8_ops.scaled_mm_rows(x, layer.weight, layer.weight_scale, None, bias, gated=True)

    def apply_normed(
        self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.weight_only or self.static_input or not fp8_ops.quantizes_normed(layer, h, residual, norm, None):
            return None
        out = fp8_ops.scaled_mm_rows(h, layer.weight, layer.weight_scale, None, bias, norm=norm, residual=residual)
        return out, residual

    def apply_experts(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fp8_experts.apply(layer, x, topk_weights, topk_ids)
