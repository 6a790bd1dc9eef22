"""Qwen3: the Llama decoder with a per-head RMSNorm on the queries and keys before rotary.

Everything else is Llama's (`rxf.plugins.models.llama`): fused qkv / gate_up parameters, no qkv bias
unless `attention_bias`, an explicit `head_dim` (128 in every released size, so 4096 / 32 heads for
the 8B but 2048 / 32 = 64 would be wrong for the 30B-A3B), tied embeddings where the config says so,
and the sliding window per layer as `LlamaAttention` reads it from `layer_types` / `sliding_window`.
Checkpoint names add `model.layers.{i}.self_attn.q_norm.weight` / `k_norm.weight` ([head_dim]
each), which load by name.
"""

from __future__ import annotations

from typing import Any

import torch

from rxf.core.forward import ForwardBatch
from rxf.plugins.models.layers import RMSNorm, RotaryEmbedding
from rxf.plugins.models.layers.head_norm import norm_heads_
from rxf.plugins.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: Any, layer_id: int, qkv_bias: bool, rotary_emb: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__(config, layer_id, qkv_bias, rotary_emb, dtype)
        self.q_norm = RMSNorm(head_dim_of(config), config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(head_dim_of(config), config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        attn = self.attn
        norm_heads_(qkv, self.q_norm, self.k_norm, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v, batch, rotary=self.rotary_emb))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attn_cls = Qwen3Attention
