"""Mixtral: the Llama/Mistral decoder with each layer's MLP replaced by a sparse mixture of experts.

Attention, norms, rotary embeddings and the logits head are Llama's (`rxf.plugins.models.llama`);
only the feed-forward block differs. Routing as transformers' `MixtralTopKRouter` defines it:
router logits from a replicated `[E, H]` linear, softmax over all experts in float32, the
`num_experts_per_tok` largest, renormalised to sum to 1.

Checkpoint names: `model.layers.{i}.block_sparse_moe.gate.weight` (router) and
`...block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down of expert e) map to `mlp.gate`
and the fused `mlp.experts.w13` / `mlp.experts.w2` parameters (see `layers/moe.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rxf.core import quantization
from rxf.core.runner.distributed import tp_all_reduce
from rxf.core.weight_loader import StackedMapping, load_named_weights
from rxf.plugins.models.layers import ColumnParallelLinear
from rxf.plugins.models.layers.moe import FusedExperts, norm_and_route, route
from rxf.plugins.models.llama import _STACKED, LlamaForCausalLM


class MixtralMoE(nn.Module):
    """Router + experts. Other sparse models reuse it with their expert width (`intermediate_size`,
    default the config's) and whether the top-k weights are rescaled to sum to 1 (`renormalize`)."""

    def __init__(
        self, config: Any, dtype: torch.dtype, *, intermediate_size: int | None = None, renormalize: bool = True
    ) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.top_k = config.num_experts_per_tok
        self.renormalize = renormalize
        # The router is replicated: every rank routes every token the same way; quantized
        # checkpoints keep it dense.
        with quantization.unquantized():
            self.gate = ColumnParallelLinear(
                config.hidden_size, config.num_local_experts, bias=False, tp_size=1, tp_rank=0, dtype=dtype
            )
        self.experts = FusedExperts(
            config.num_local_experts, config.hidden_size, intermediate_size or config.intermediate_size, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.gate, self.top_k, renormalize=self.renormalize)
        return tp_all_reduce(self.experts(x, weights, ids))  # each rank holds a slice of every expert

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this block's output for norm(h + residual), h + residual), the residual add and the norm
        inside the routing launch (`moe.norm_and_route`); None where that does not apply, and the
        caller (`LlamaDecoderLayer`) runs the norm itself."""
        routed = norm_and_route(h, residual, norm, self.gate, self.top_k, self.renormalize)
        if routed is None:
            return None
        weights, ids, x, residual = routed
        return tp_all_reduce(self.experts(x, weights, ids)), residual


def expert_mapping(
    num_experts: int, moe: str = "block_sparse_moe", projections: tuple[str, str, str] = ("w1", "w3", "w2")
) -> StackedMapping:
    """Checkpoint name parts of every expert's projections -> fused parameter and shard id: the
    block's name in the checkpoint (`moe`) and its experts' (gate, up, down) projection names."""
    gate, up, down = projections
    mapping: list[tuple[str, str, Any]] = [("mlp.gate", f"{moe}.gate", None)]  # a plain rename
    for e in range(num_experts):
        mapping += [
            ("mlp.experts.w13", f"{moe}.experts.{e}.{gate}", (e, 0)),
            ("mlp.experts.w13", f"{moe}.experts.{e}.{up}", (e, 1)),
            ("mlp.experts.w2", f"{moe}.experts.{e}.{down}", (e, 0)),
        ]
    return mapping


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_cls = MixtralMoE

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stacked = [*_STACKED, *expert_mapping(self.config.num_local_experts)]
        load_named_weights(self, weights, stacked=stacked, skip=self._skip)
