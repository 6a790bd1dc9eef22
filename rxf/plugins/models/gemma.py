"""Gemma 2 and Gemma 3 (text) over the paged KV pool.

What differs from Llama (`llama.py`, whose fused qkv / gate_up loading this reuses):
- layers alternate local sliding-window attention and global attention (`config.layer_types`,
  which transformers' config classes derive from older configs' pattern fields), and the two kinds
  may rotate with different rope bases (Gemma 3: 10k local, 1M global with linear scaling);
- scores are scaled by `query_pre_attn_scalar ** -0.5`, not `head_dim ** -0.5`;
- Gemma 2 soft-caps attention scores (`attn_logit_softcapping`) and both soft-cap the final logits
  (`final_logit_softcapping`), `cap * tanh(x / cap)`; Gemma 3 normalises q and k per head instead
  of capping scores (its config may carry an `attn_logit_softcapping`, which transformers ignores
  for Gemma 3, and so does rxf);
- four norms per layer (before and after attention, before and after the MLP), each
  `x / rms(x) * (1 + weight)` in float32;
- embeddings scaled by sqrt(hidden_size), rounded to the model dtype first (as transformers does);
- a gelu-tanh GLU; tied embeddings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rxf.core.forward import ForwardBatch
from rxf.core.weight_loader import load_named_weights
from rxf.plugins.models.layers import (
    LogitsHead,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RadixAttention,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    rope_parameters,
)
from rxf.plugins.models.layers.activation import GeluTanhAndMul
from rxf.plugins.models.layers.bidirectional_blocks import BidirectionalBlocks
from rxf.plugins.models.layers.norm import GemmaRMSNorm
from rxf.plugins.models.layers.rope_scaling import scaled_context_length
from rxf.plugins.models.llama import _STACKED, _effective_window, final_hidden_states, head_dim_of

logger = logging.getLogger(__name__)

LAYER_TYPES = ("sliding_attention", "full_attention")


class GemmaScaledEmbedding(VocabEmbedding):
    """Token embeddings times sqrt(hidden_size); the factor is rounded to the model dtype before the
    multiply (55.4256 becomes 55.5 in bfloat16 for hidden 3072), as the checkpoints were trained."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden_size, dtype=dtype)
        self.register_buffer("normalizer", torch.tensor(hidden_size**0.5, dtype=dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.normalizer


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        act = config.hidden_activation
        if act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], False, dtype=dtype)
        self.act = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, dtype=dtype)
        self.gate_up_proj.use_decode_gemv("gate_up_proj")
        self.down_proj.use_decode_gemv("down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act=self.act)


class GemmaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype, *,
        qk_norm: bool, logit_cap: float | None, served: int,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias, dtype=dtype)
        self.rotary_emb = rotary_emb  # shared by the layers of its type
        self.qkv_sizes = [s * head_dim for s in (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads)]
        self.qkv_sizes.append(self.qkv_sizes[1])
        # Per-head norms of q and k before the rotation (Gemma 3); replicated across ranks.
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        local = config.layer_types[layer_id] == "sliding_attention"
        self.attn = RadixAttention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            config.query_pre_attn_scalar**-0.5,
            sliding_window=_effective_window(config.sliding_window, served) if local else None,
            logit_cap=logit_cap,
        )
        self.qkv_proj.use_decode_gemv("qkv_proj")
        self.o_proj.use_decode_gemv("o_proj")

    def _per_head(self, norm: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
        # [n, heads * head_dim] -> one row per head (2-D and contiguous: the fused norm's layout).
        return norm(x.reshape(-1, self.head_dim)).view(x.shape)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, blocks: BidirectionalBlocks | None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._per_head(self.q_norm, q), self._per_head(self.k_norm, k)
        block_q = None if blocks is None else blocks.queries(q, k, batch.positions, self.rotary_emb)
        out = self.attn(q, k, v, batch, rotary=self.rotary_emb)
        if blocks is not None:
            blocks.attend(block_q, self.attn, batch, out)  # images attend both ways (Gemma 3)
        return self.o_proj(out)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype, **attn: Any):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = GemmaAttention(config, layer_id, rotary_emb, dtype, **attn)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GemmaMLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, blocks: BidirectionalBlocks | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately: each pre-norm fuses the add of the block
        # output before it (post-normed) into the stream, as in llama.py.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, batch, blocks))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def _rotary_by_layer_type(config: Any, dtype: torch.dtype, served: int) -> dict[str, RotaryEmbedding]:
    """One rotary table per distinct rope setting (its cos/sin cover every position served), shared
    by the layer types that use it."""
    tables: dict[str, RotaryEmbedding] = {}
    by_params: dict[str, RotaryEmbedding] = {}
    for layer_type in dict.fromkeys(config.layer_types):
        params = rope_parameters(config, layer_type)
        key = repr(sorted(params.items()))
        if key not in by_params:
            by_params[key] = RotaryEmbedding(head_dim_of(config), served, params, dtype)
        tables[layer_type] = by_params[key]
    return tables


class GemmaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, served: int, **attn: Any) -> None:
        """`served`: the longest sequence served (rotary tables; a window that covers it is none)."""
        super().__init__()
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise NotImplementedError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
        self.embed_tokens = GemmaScaledEmbedding(config.vocab_size, config.hidden_size, dtype)
        rotary = _rotary_by_layer_type(config, dtype, served)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, rotary[t], dtype, served=served, **attn)
            for i, t in enumerate(config.layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual stream, before the final norm (see llama.py)."""
        x = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        blocks = BidirectionalBlocks.of(batch)  # image tokens of this forward (multimodal Gemma 3)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, blocks)
        assert residual is not None, "a model has at least one layer"
        return x, residual


class Gemma2ForCausalLM(nn.Module):
    qk_norm = False  # Gemma 3 normalises q and k per head
    caps_attention = True  # Gemma 2 soft-caps attention scores (attn_logit_softcapping)

    @classmethod
    def max_context_length(cls, config: Any) -> int:
        """The longest context the rope of every layer type is made for (see llama.py)."""
        return min(
            scaled_context_length(rope_parameters(config, t), int(config.max_position_embeddings))
            for t in set(config.layer_types)
        )

    def __init__(self, config: Any, dtype: torch.dtype | None = None, context_length: int | None = None) -> None:
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("use_bidirectional_attention (an embedding model, not a decoder) is not supported")
        self.config = config
        cap = getattr(config, "attn_logit_softcapping", None) if self.caps_attention else None
        served = context_length or self.max_context_length(config)
        self.model = GemmaModel(config, dtype, served, qk_norm=self.qk_norm, logit_cap=cap)
        self.final_logit_cap = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = LogitsHead(config.vocab_size, config.hidden_size, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # the unscaled embedding matrix
        self.lm_head.use_decode_gemv()

    def forward(self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits `[len(batch.logits_indices), vocab]`, soft-capped where the config says."""
        logits = self.lm_head(self.hidden_states(batch, input_embeds))
        if self.final_logit_cap is not None:  # in place: under a CUDA-graph capture the head's rows are
            cap = float(self.final_logit_cap)  # the buffer every bucket shares (`LogitsHead.graph_output`)
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def hidden_states(self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """What the logits head reads, and what an embedding model pools: `final_hidden_states`."""
        return final_hidden_states(self.model, batch, input_embeds)

    def _skip(self, name: str) -> bool:
        # Tied checkpoints may still store the head (transformers 4 saved it).
        return self.tie_word_embeddings and name == "lm_head.weight"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, stacked=_STACKED, skip=self._skip)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    caps_attention = False
