"""Gemma (the first generation: `GemmaForCausalLM`) over rxf's paged KV pool, built from rxf's
public model layers; attention goes through whichever backend `attention.backend` selects.

How Gemma differs from Llama, each as transformers computes it:
- the token embeddings are multiplied by sqrt(hidden_size), that factor first rounded to the
  model dtype;
- RMSNorm scales by `1 + weight`: `GemmaRMSNorm` adds the 1 when the weight loads (in float32),
  so rxf's RMSNorm, including its fused GPU kernel, runs unchanged;
- the MLP gates with GELU (tanh approximation for `gelu_pytorch_tanh`, exact for `gelu`);
- `head_dim` is explicit (256 in the released models, where heads * head_dim != hidden_size);
- the LM head shares the embedding matrix (`tie_word_embeddings`, true for every released model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rxf.core.forward import ForwardBatch
from rxf.core.weight_loader import load_named_weights
from rxf.plugins.models.layers import (
    LogitsHead,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RadixAttention,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
    rope_parameters,
)

# (fused parameter, checkpoint projection, shard id): q/k/v and gate/up load into fused weights.
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# transformers' activation names -> the `approximate` argument of F.gelu.
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GemmaRMSNorm(RMSNorm):
    """Stores `1 + checkpoint weight`, so the inherited forward computes Gemma's norm."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.weight_loader = self._load_offset_weight

    @staticmethod
    def _load_offset_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(loaded.float() + 1.0)


class GeluAndMul(nn.Module):
    """`gelu(gate) * up` over a fused `[gate | up]` projection output."""

    def __init__(self, activation: str) -> None:
        super().__init__()
        if activation not in _GELU:
            raise NotImplementedError(f"Gemma hidden activation {activation!r} (supported: {', '.join(_GELU)})")
        self.approximate = _GELU[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        inter = config.intermediate_size
        # Older Gemma configs name the activation `hidden_activation`; transformers 5 uses `hidden_act`.
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], dtype=dtype)
        self.act = GeluAndMul(activation)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias, dtype=dtype)
        self.rotary_emb = rotary_emb  # shared by all layers
        q_size = self.qkv_proj.num_heads * head_dim
        kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]  # this rank's q | k | v split
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q, k = self.rotary_emb(batch.positions, q, k)
        return self.o_proj(self.attn(q, k, v, batch))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, rotary_emb: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = GemmaAttention(config, layer_id, rotary_emb, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GemmaMLP(config, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm; the residual stream is carried beside x so that each norm does the add.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GemmaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        # A buffer (not a Python float) so the multiply stays on the device and CUDA-graph capturable.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False)
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, rope_parameters(config), dtype)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, rotary_emb, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual stream, before the final norm."""
        x = self.embed_tokens(batch.input_ids) * self.normalizer
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        assert residual is not None, "a model has at least one layer"
        return x, residual


class GemmaForCausalLM(nn.Module):
    """rxf's model contract: built as `cls(hf_config, dtype=...)`, `forward(batch)` returns float32
    logits for the rows `batch.logits_indices`, `load_weights` takes `(name, tensor)` pairs."""

    def __init__(self, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        self.config = config
        self.model = GemmaModel(config, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = LogitsHead(config.vocab_size, config.hidden_size, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.model(batch)
        idx = batch.logits_indices  # normalise only the rows whose logits are returned
        x, _ = self.model.norm(x[idx], residual[idx])
        return self.lm_head(x)

    def _skip(self, name: str) -> bool:
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, stacked=_STACKED, skip=self._skip)
