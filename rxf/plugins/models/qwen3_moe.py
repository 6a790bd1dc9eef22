"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with sparse mixture-of-experts feed-forward blocks.

Layer i is sparse when it is not in `mlp_only_layers`, the config has experts and
`(i + 1) % decoder_sparse_step == 0` (transformers' rule); the other layers keep a dense gated MLP
of `intermediate_size`. A sparse block routes as transformers' `Qwen3MoeTopKRouter`: softmax over
all `num_experts` in float32, the `num_experts_per_tok` largest, rescaled to sum to 1 only when
`norm_topk_prob` (Qwen3-30B-A3B: 128 experts, top 8, rescaled); each expert is a gated MLP of
`moe_intermediate_size` (`MixtralMoE`'s router + `FusedExperts`).

Checkpoints come in two layouts, both loaded:
- per expert, as the released checkpoints (and transformers' `save_pretrained`) store them:
  `model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, router `mlp.gate.weight`;
- fused, transformers 5's in-memory layout (`save_pretrained(..., save_original_format=False)`):
  `mlp.experts.gate_up_proj` `[E, 2 * I, H]` (rows `[gate | up]`) and `mlp.experts.down_proj`
  `[E, H, I]`, split here into the per-expert tensors above (views, no copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rxf.core.weight_loader import load_named_weights
from rxf.plugins.models.llama import _STACKED, LlamaMLP
from rxf.plugins.models.mixtral import MixtralMoE, expert_mapping
from rxf.plugins.models.qwen3 import Qwen3ForCausalLM

_FUSED_GATE_UP, _FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % step == 0
    )


def _layers_fill_in_later(config: Any, dtype: torch.dtype) -> nn.Module:
    """What LlamaModel builds as each layer's feed-forward block: nothing (no parameters), as
    `Qwen3MoeForCausalLM` then puts in the dense or sparse block that layer's index calls for."""
    return nn.Identity()


def per_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with fused expert stacks split into per-expert checkpoint names."""
    for name, tensor in weights:
        fused = next((s for s in (_FUSED_GATE_UP, _FUSED_DOWN) if name.endswith(s)), None)
        if fused is None:
            yield name, tensor
            continue
        if tensor.dim() != 3 or (fused == _FUSED_GATE_UP and tensor.shape[1] % 2):
            raise ValueError(f"fused expert tensor {name} has shape {tuple(tensor.shape)}: expected "
                             + ("[experts, 2 * intermediate, hidden]" if fused == _FUSED_GATE_UP
                                else "[experts, hidden, intermediate]"))
        prefix = name[: -len(fused)] + ".mlp.experts"
        for e in range(tensor.shape[0]):
            if fused == _FUSED_GATE_UP:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    mlp_cls = staticmethod(_layers_fill_in_later)

    def __init__(self, config: Any, dtype: torch.dtype | None = None, context_length: int | None = None) -> None:
        super().__init__(config, dtype, context_length)
        dtype = dtype or torch.get_default_dtype()
        for i, layer in enumerate(self.model.layers):
            if is_sparse_layer(config, i):
                layer.mlp = MixtralMoE(
                    config, dtype, intermediate_size=config.moe_intermediate_size, renormalize=config.norm_topk_prob
                )
            else:
                layer.mlp = LlamaMLP(config, dtype)

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """transformers' Qwen3-MoE has no `layer_types`: `sliding_window` (None unless
        `use_sliding_window`) applies to every layer."""
        return [config.sliding_window] * config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Expert names first: `.gate_proj.` of an expert would otherwise match the dense MLP's mapping.
        experts = expert_mapping(self.config.num_experts, "mlp", ("gate_proj", "up_proj", "down_proj"))
        load_named_weights(self, per_expert_tensors(weights), stacked=[*experts, *_STACKED], skip=self._skip)
