"""gpt-oss (OpenAI's open-weight MoE models): the Llama decoder with attention sinks, alternating
sliding-window and full layers, biases on every projection, and a mixture of experts whose router
has a bias and whose experts use a clamped SwiGLU with biases.

As transformers' `modeling_gpt_oss` defines it:
- attention: q/k/v/o with biases; per head a learned sink logit that joins the softmax's
  denominator (`RadixAttention(sinks=...)`); layer i attends a `sliding_window` of keys when
  `layer_types[i]` is "sliding_attention", else the whole causal context; yarn rope.
- MoE: router logits = x W^T + b, the top k logits, softmax over those k (= a softmax over all
  experts renormalised over the top k, which is how `select_experts` computes it); expert e's
  `gate_up = x W_e + b_e` with gate and up *interleaved* (columns 2j and 2j + 1), then
  `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with g = min(gate, limit), then
  `down(.) + b_e`.

Checkpoint names (`model.layers.{i}.`): `self_attn.{q,k,v,o}_proj.{weight,bias}`,
`self_attn.sinks` `[heads]`, `mlp.router.{weight,bias}`, and the experts stacked over experts:
`mlp.experts.gate_up_proj` `[E, H, 2I]` / `down_proj` `[E, I, H]` (the bf16 layout transformers
saves, `x @ W`), or in OpenAI's release `mlp.experts.gate_up_proj_blocks` / `_scales` and
`down_proj_blocks` / `_scales` (MXFP4, `[E, out, in]` once dequantized, see `layers/mxfp4.py`),
plus `mlp.experts.gate_up_proj_bias` `[E, 2I]` / `down_proj_bias` `[E, H]`. `load_weights` turns
them into per-expert `[out, in]` tensors with gate and up de-interleaved, which `FusedExperts`'
loaders slice for this tensor-parallel rank; MXFP4 is dequantized to the model dtype on the
model's device, one expert at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rxf.core import quantization
from rxf.core.runner.distributed import tp_all_reduce
from rxf.core.weight_loader import StackedMapping, load_named_weights
from rxf.plugins.models.layers import ColumnParallelLinear, RadixAttention, RotaryEmbedding
from rxf.plugins.models.layers.linear import copy_weight
from rxf.plugins.models.layers.moe import FusedExperts, GatedActivation, norm_and_route, route
from rxf.plugins.models.layers.mxfp4 import dequantize_mxfp4
from rxf.plugins.models.llama import _STACKED, LlamaAttention, LlamaForCausalLM, head_dim_of

# `<prefix>.mlp.experts.<proj>[_blocks|_scales|_bias]`, the experts' stacked checkpoint tensors.
_EXPERT_TENSOR = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>_blocks|_scales|_bias)?")


class GptOssAttention(LlamaAttention):
    """Llama's attention block (with this layer's window) plus the per-head sinks: float32, this
    rank's heads, a parameter of this block that its `attn` reads."""

    def __init__(
        self, config: Any, layer_id: int, qkv_bias: bool, rotary_emb: RotaryEmbedding, dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(config, layer_id, qkv_bias, rotary_emb, dtype, sliding_window)
        heads = self.qkv_proj.num_heads
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        self.attn = RadixAttention(
            layer_id, heads, self.qkv_proj.num_kv_heads, head_dim_of(config),
            sliding_window=sliding_window, sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        if loaded.dim() != 1 or loaded.shape[0] != n * self.qkv_proj.tp_size:
            raise ValueError(f"sinks: checkpoint shape {tuple(loaded.shape)} does not fit {n} heads "
                             f"x tp_size {self.qkv_proj.tp_size}")
        copy_weight(param.data, loaded.narrow(0, self.qkv_proj.tp_rank * n, n), "sinks")


class GptOssMoE(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        # The router is replicated: every rank routes every token the same way; it stays dense.
        with quantization.unquantized():
            self.router = ColumnParallelLinear(
                config.hidden_size, config.num_local_experts, bias=True, tp_size=1, tp_rank=0, dtype=dtype
            )
        # Configs of transformers before 5.2x carry neither field: their modeling code fixed 1.702 and 7.0.
        activation = GatedActivation(
            alpha=float(getattr(config, "swiglu_alpha", 1.702)), limit=float(getattr(config, "swiglu_limit", 7.0)),
            up_offset=1.0,
        )
        self.experts = FusedExperts(
            config.num_local_experts, config.hidden_size, config.intermediate_size, bias=True,
            activation=activation, dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, renormalize=True)
        return tp_all_reduce(self.experts(x, weights, ids))  # each rank holds a slice of every expert

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As `MixtralMoE.forward_normed`: the residual add and the norm inside the routing launch."""
        routed = norm_and_route(h, residual, norm, self.router, self.top_k, True)
        if routed is None:
            return None
        weights, ids, x, residual = routed
        return tp_all_reduce(self.experts(x, weights, ids)), residual


def expert_mapping(num_experts: int) -> StackedMapping:
    """The per-expert names `split_expert_tensors` yields -> fused parameter and shard id."""
    mapping: list[tuple[str, str, Any]] = []
    for e in range(num_experts):
        mapping += [
            ("mlp.experts.w13", f"mlp.experts.{e}.gate", (e, 0)),
            ("mlp.experts.w13", f"mlp.experts.{e}.up", (e, 1)),
            ("mlp.experts.w2", f"mlp.experts.{e}.down", (e, 0)),
        ]
    return mapping


def _per_expert(prefix: str, proj: str, what: str, stacked: Iterable[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert e's `[out, in]` weight or `[out]` bias as `{prefix}.{e}.{gate|up|down}.{what}`; gate_up's
    rows are interleaved (gate j at 2j, up j at 2j + 1)."""
    for e, tensor in enumerate(stacked):
        if proj == "down_proj":
            yield f"{prefix}.{e}.down.{what}", tensor
        else:
            yield f"{prefix}.{e}.gate.{what}", tensor[0::2]
            yield f"{prefix}.{e}.up.{what}", tensor[1::2]


def split_expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each stacked expert tensor replaced by per-expert ones (see the
    module docstring); an MXFP4 weight is yielded once both its blocks and its scales have come
    (they may sit in different files), dequantized to `dtype` on `device`."""
    halves: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 weights waiting for their other half
    for name, tensor in weights:
        m = _EXPERT_TENSOR.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        prefix, proj, kind = m["prefix"], m["proj"], m["kind"]
        if kind == "_bias":
            if tensor.dim() != 2:
                raise ValueError(f"{name}: expected [experts, features], got shape {tuple(tensor.shape)}")
            yield from _per_expert(prefix, proj, "bias", tensor)
            continue
        if kind is None:  # transformers' layout, [E, in, out]
            if tensor.dim() != 3:
                raise ValueError(f"{name}: expected [experts, in, out], got shape {tuple(tensor.shape)}")
            yield from _per_expert(prefix, proj, "weight", tensor.transpose(1, 2))
            continue
        pending = halves.setdefault(f"{prefix}.{proj}", {})
        pending[kind] = tensor
        if len(pending) < 2:
            continue
        del halves[f"{prefix}.{proj}"]
        blocks, scales = pending["_blocks"], pending["_scales"]
        if blocks.dim() != 4:
            raise ValueError(f"{prefix}.{proj}_blocks: expected [experts, out, in / 32, 16], got {tuple(blocks.shape)}")
        try:
            dense = (dequantize_mxfp4(b.to(device), s, dtype) for b, s in zip(blocks, scales, strict=True))
            yield from _per_expert(prefix, proj, "weight", dense)
        except ValueError as e:
            raise ValueError(f"{prefix}.{proj}: {e}") from None
    if halves:
        lone = [f"{n}{next(iter(h))}" for n, h in halves.items()]
        raise ValueError(f"MXFP4 tensors without their blocks/scales partner: {', '.join(sorted(lone))}")


class GptOssForCausalLM(LlamaForCausalLM):
    native_quant_methods = ("mxfp4",)  # its MXFP4 experts load here, not through a quantization method
    qkv_bias_default = True
    mlp_cls = GptOssMoE
    attn_cls = GptOssAttention

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """`sliding_window` on the "sliding_attention" layers of `layer_types` (transformers fills
        it, alternating from a sliding layer 0, when a config.json lacks it)."""
        return [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        ref = self.model.embed_tokens.weight
        stacked = [*_STACKED, *expert_mapping(self.config.num_local_experts)]
        load_named_weights(self, split_expert_tensors(weights, ref.dtype, ref.device), stacked=stacked, skip=self._skip)
