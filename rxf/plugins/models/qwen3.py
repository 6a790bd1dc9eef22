"""Qwen3: the Llama decoder with a per-head RMSNorm on the queries and keys before rotary.

Everything else is Llama's (`rxf.plugins.models.llama`): fused qkv / gate_up parameters, no qkv bias
unless `attention_bias`, an explicit `head_dim` (128 in every released size: hidden / heads for the
8B, 4096 / 32, but not for the 30B-A3B, 2048 / 32), tied embeddings where the config says so,
and Qwen2's sliding window per layer (`layer_types`: layers from `max_window_layers` on slide when
`use_sliding_window`; transformers 5 fills it in).
Checkpoint names add `model.layers.{i}.self_attn.q_norm.weight` / `k_norm.weight` ([head_dim]
each), which load by name.
"""

from __future__ import annotations

from typing import Any

import torch

from rxf.core.forward import ForwardBatch
from rxf.plugins.models.layers import RMSNorm
from rxf.plugins.models.layers.head_norm import HeadNormedRotary, norm_heads_
from rxf.plugins.models.llama import LlamaAttention, Qwen2ForCausalLM, head_dim_of


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, *args: Any) -> None:
        """LlamaAttention's arguments; adds the per-head norms (in the projections' dtype)."""
        super().__init__(config, *args)
        dtype = self.qkv_proj.weight.dtype
        self.q_norm = RMSNorm(head_dim_of(config), config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(head_dim_of(config), config.rms_norm_eps, dtype)
        # A plain attribute (not a submodule): the norms and the rotary stay registered where they are.
        self.normed_rotary = HeadNormedRotary(self.rotary_emb, self.q_norm, self.k_norm, head_dim_of(config))

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        attn, backend = self.attn, batch.attn_backend
        if backend.fuses_head_norm and backend.fuses_rope(self.rotary_emb):
            rotary = self.normed_rotary  # the norms run in the backend's rope + K/V store launch
        else:
            norm_heads_(qkv, self.q_norm, self.k_norm, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            rotary = self.rotary_emb
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v, batch, rotary=rotary))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's windows per layer (`layer_types`), without its default q/k/v biases."""

    qkv_bias_default = False
    attn_cls = Qwen3Attention
