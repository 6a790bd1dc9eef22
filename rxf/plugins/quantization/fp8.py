"""`fp8`: Hugging Face's block-wise FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3), and online FP8.

A checkpoint's `quantization_config`: `{"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic", "modules_to_not_convert": [...]}`; each quantized projection stores
`weight` (float8_e4m3fn `[N, K]`) and `weight_scale_inv` (float32 `[ceil(N / bn), ceil(K / bk)]`,
the factor that multiplies each block back: `w = weight * weight_scale_inv`, despite its name).

Online (`model.quantization = "fp8"` on an unquantized checkpoint): the layers load their dense
weight, then quantize it per output row (scales `[N]`, the absmax of each row mapped to 448).
MoE experts in both forms: see `fp8_experts` (weight-only FP8 in the fused MoE kernels).

On CUDA the layers compute in FP8: activations quantized per token (per token and group of bk for
the block layout) as the layer runs; decode batches of at most 8 rows take the weight-only FP8 GEMV
instead (`qgemv.py`: bf16 / fp16 activations as they are, the weight read once). Elsewhere they are
dequantized at load to the model's dtype (the online path then rounds the weights through FP8, so
the CPU computes what the GPU's weights hold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rxf.plugins.models.layers.linear import DENSE, TensorLayout
from rxf.plugins.models.layers.moe import FusedExperts
from rxf.plugins.quantization import fp8_experts, fp8_ops, qgemv
from rxf.plugins.quantization.base import LinearMethod, become_dense, config_value
from rxf.plugins.quantization.fp8_experts import SCALE_DTYPES as _SCALE_DTYPES


class Fp8Method(LinearMethod):
    name = "fp8"

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        self.online = quant_config is None
        if self.online:
            return
        method = quant_config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"model.quantization 'fp8' cannot read a checkpoint quantized with {method!r}; "
                             f"leave model.quantization unset to load it with {method!r}")
        config_value(quant_config, "activation_scheme", ("dynamic",), "fp8")
        block = quant_config.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"fp8: quantization_config.weight_block_size = {block!r}: expected [rows, cols] "
                             "(per-tensor FP8 checkpoints load as compressed-tensors)")
        self.block_n, self.block_k = block
        self.skipped = tuple(quant_config.get("modules_to_not_convert") or ())

    def quantizes_experts(self, name: str) -> bool:
        return True

    def create_weights(self, layer: nn.Module) -> None:
        if self.online:
            layer.create_dense_weight()  # loads as usual, quantized in process_loaded
            return
        if isinstance(layer, FusedExperts):
            fp8_experts.create_block(layer, self.block_n, self.block_k)
            return
        n, k = layer.out_per_rank, layer.in_per_rank
        layer.add_param("weight", torch.empty(n, k, dtype=fp8_ops.FP8), TensorLayout(dtypes=(fp8_ops.FP8,)))
        scale = layer.add_param(
            "weight_scale_inv", torch.empty(n, -(-k // self.block_k), dtype=torch.float32),
            TensorLayout(in_pack=self.block_k, dtypes=_SCALE_DTYPES),
        )
        dense_loader = scale.weight_loader

        def load_block_scales(param: nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
            # One row of block scales per output row: the loader then slices them like the weight.
            dense_loader(param, loaded.repeat_interleave(self.block_n, dim=0) if loaded.dim() == 2 else loaded, *shard)

        scale.weight_loader = load_block_scales

    def process_loaded(self, layer: nn.Module) -> None:
        if isinstance(layer, FusedExperts):
            if self.online:
                fp8_experts.quantize_online(layer)
            else:
                fp8_experts.process_block(layer, self.block_k)
            return
        if self.online:
            q, scale = fp8_ops.quantize_rows(layer.weight.data)
            if layer.weight.is_cuda:
                layer.add_param("weight", q, DENSE)
                layer.add_param("weight_scale", scale, DENSE)
                layer.qgemv = qgemv.fp8_rows(layer)
            else:
                become_dense(layer, fp8_ops.dequantize_rows(q, scale, layer.dtype), ("weight",))
            return
        if not layer.weight.is_cuda:
            dense = fp8_ops.dequantize_blocks(layer.weight.data, layer.weight_scale_inv.data, self.block_k, layer.dtype)
            become_dense(layer, dense, ("weight", "weight_scale_inv"))
            return
        layer.qgemv = qgemv.fp8_blocks(layer, self.block_n, self.block_k)
        layer.cublas_scale = fp8_ops.cublas_block_scales(
            layer.weight.data, layer.weight_scale_inv.data, self.block_n, self.block_k)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.qgemv is not None and layer.qgemv.takes(x):  # decode batches: weight-only FP8 GEMV
            return layer.qgemv(x, bias)
        return self._fp8_linear(layer, x, bias)

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, act: nn.Module, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if not fp8_ops.quantizes_gated(layer, x, act):
            return None
        return self._fp8_linear(layer, x, bias, gated=True)

    def apply_normed(
        self, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not fp8_ops.quantizes_normed(layer, h, residual, norm, None if self.online else self.block_k):
            return None
        return self._fp8_linear(layer, h, bias, norm=norm, residual=residual), residual

    def _fp8_linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, **fused: Any) -> torch.Tensor:
        if self.online:
            return fp8_ops.scaled_mm_rows(x, layer.weight, layer.weight_scale, None, bias, **fused)
        return fp8_ops.block_fp8_linear(
            x, layer.weight, layer.weight_scale_inv, self.block_k, bias, layer.cublas_scale, **fused)

    def apply_experts(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fp8_experts.apply(layer, x, topk_weights, topk_ids)
