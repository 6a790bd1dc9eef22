"""EAGLE-3 draft heads (`LlamaForCausalLMEagle3`): one Llama decoder layer that reads a target's
hidden states, run by `rxf/core/speculative/eagle.py` beside the target over the paged KV pool.

Checkpoint layout, as the public heads ship it (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
lmsys/sglang-EAGLE3-*): `config.json` is a Llama config with `architectures`
["LlamaForCausalLMEagle3"], `num_hidden_layers` 1, the target's `vocab_size`, `draft_vocab_size`
(the head's own output vocabulary, e.g. 32000 of Llama 3's 128256; default: the whole vocabulary),
optionally `target_hidden_size` (default `hidden_size`) and `norm_before_residual` (default false),
and which target layers it reads (`rxf.core.speculative.eagle.aux_layer_ids`). Tensors (names may
also carry a `model.` prefix, and `layers.0.` for `midlayer.`):

    fc.weight                                  [hidden, 3 * target_hidden]  fuses the 3 target states
    midlayer.input_layernorm.weight            [hidden]                     norms the token embedding
    midlayer.hidden_norm.weight                [hidden]                     norms the fused state
    midlayer.self_attn.{q,k,v}_proj.weight     [heads * head_dim, 2 * hidden]: read [embedding ; state]
    midlayer.self_attn.o_proj.weight           [hidden, heads * head_dim]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight (Llama's)
    norm.weight                                [hidden]
    lm_head.weight                             [draft_vocab_size, hidden]
    d2t                                        int [draft_vocab_size]: target id = draft id + d2t[draft id]
    t2d                                        bool [vocab_size]: the target ids the draft vocabulary has
    embed_tokens.weight (optional)             [vocab_size, hidden]; without it the target's embedding

The forward at position p reads the token x_{p+1} after it and a state s_p: the target's three
hidden states at p fused by `fc`, or (while drafting) the head's own feature from position p - 1:

    residual = s_p                              (hidden_norm(s_p) with norm_before_residual)
    a = self_attn([input_layernorm(embed(x_{p+1})) ; hidden_norm(s_p)])   causal over the head's own
                                                KV, rotated at position p
    h, residual = post_attention_layernorm(a + residual), a + residual
    feature = mlp(h) + residual                 the state of position p + 1 (before the final norm)
    logits = lm_head(norm(feature))             draft ids; the argmax d predicts x_{p+2} = d + d2t[d]

t2d is not needed (the head only maps draft ids to target ids) and is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rxf.core.forward import ForwardBatch
from rxf.core.weight_loader import load_named_weights
from rxf.plugins.models.layers import (
    ColumnParallelLinear,
    LogitsHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    rope_parameters,
)
from rxf.plugins.models.llama import _STACKED, LlamaAttention, LlamaMLP, head_dim_of

logger = logging.getLogger(__name__)


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q / k / v projections read 2 x hidden inputs: [embedding ; state]."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, dtype: torch.dtype) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, 0, bias, rotary_emb, dtype)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        # Replaces the hidden-wide projection Llama's block built (freed here, once, at load).
        self.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size, head_dim_of(config), num_heads, num_kv_heads, bias, dtype=dtype
        )


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.hidden_norm = RMSNorm(hidden, eps, dtype)
        self.self_attn = Eagle3Attention(config, rotary_emb, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(
        self, embeds: torch.Tensor, state: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream); `state` may be overwritten (fused norms work in place)."""
        normed = self.hidden_norm(state)
        residual = normed if self.norm_before_residual else state
        x = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLMEagle3(nn.Module):
    # Not a model to serve: `ModelRunner(draft_of=target)` builds it for `speculative.method = "eagle3"`.
    is_draft_head = True

    def __init__(self, config: Any, dtype: torch.dtype | None = None, context_length: int | None = None) -> None:
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        if config.num_hidden_layers != 1:
            raise ValueError(f"EAGLE-3 heads of one decoder layer are served; this one has {config.num_hidden_layers}")
        hidden = config.hidden_size
        self.config = config
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or hidden)
        if 3 * self.target_hidden_size == hidden:  # the forward tells target states from features by width
            raise ValueError(f"an EAGLE-3 head with hidden_size {hidden} = 3 x target_hidden_size is not supported")
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("EAGLE-3 heads whose lm_head is their embedding (tie_word_embeddings) are not supported")
        rotary = RotaryEmbedding(
            head_dim_of(config), context_length or config.max_position_embeddings, rope_parameters(config), dtype
        )
        # The three target states are replicated on every tensor-parallel rank, and so is fc.
        self.fc = ColumnParallelLinear(
            3 * self.target_hidden_size, hidden, bool(getattr(config, "bias", False)), tp_size=1, tp_rank=0, dtype=dtype
        )
        self.midlayer = Eagle3DecoderLayer(config, rotary, dtype)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.lm_head = LogitsHead(self.draft_vocab_size, hidden, dtype=dtype)
        # The target id of each draft id (identity until the checkpoint's d2t is loaded).
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)
        self.embed_tokens: VocabEmbedding | None = None  # the checkpoint's, or the target's (`share_embedding`)

    def share_embedding(self, embedding: VocabEmbedding) -> None:
        """Read tokens through the target's embedding (a head whose checkpoint has none)."""
        if embedding.weight.shape[1] != self.config.hidden_size or embedding.vocab_size != self.vocab_size:
            raise ValueError(
                f"the target's embedding is [{embedding.vocab_size}, {embedding.weight.shape[1]}]; the head needs "
                f"[{self.vocab_size}, {self.config.hidden_size}] (hidden_size and vocab_size of its config)"
            )
        self.embed_tokens = embedding

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits over the draft vocabulary for `batch.logits_indices`; sets `batch.aux_hidden`
        to those rows' features. `batch.spec_hidden` holds each new token's state: target states
        ([n, 3 x target_hidden], fused by fc) or features ([n, hidden]); it may be overwritten."""
        state = batch.spec_hidden
        if state is None or self.embed_tokens is None:
            raise ValueError("an EAGLE-3 head needs ForwardBatch.spec_hidden and an embedding")
        if state.shape[-1] == 3 * self.target_hidden_size:
            state = self.fc(state)
        x, residual = self.midlayer(self.embed_tokens(batch.input_ids), state, batch)
        if not batch.mode.is_decode():
            idx = batch.logits_indices
            x, residual = x[idx], residual[idx]
        normed, feature = self.norm(x, residual)
        batch.aux_hidden = feature
        return self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen_d2t = False

        def layer_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal seen_d2t
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("layers.0."):
                    name = "midlayer." + name.removeprefix("layers.0.")
                if name == "d2t":
                    self._load_d2t(tensor)
                    seen_d2t = True
                elif name == "embed_tokens.weight":
                    self._load_embedding(tensor)
                elif name != "t2d" and "rotary_emb.inv_freq" not in name:
                    yield name, tensor

        load_named_weights(self, layer_tensors(), stacked=_STACKED)
        if not seen_d2t and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                f"the head's draft_vocab_size {self.draft_vocab_size} differs from vocab_size {self.vocab_size} "
                "but the checkpoint has no d2t tensor (draft id -> target id offsets)"
            )

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        if d2t.shape != (self.draft_vocab_size,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise ValueError(
                f"d2t must be an integer tensor [{self.draft_vocab_size}] (draft_vocab_size), "
                f"got {str(d2t.dtype).removeprefix('torch.')} {list(d2t.shape)}"
            )
        target = torch.arange(self.draft_vocab_size) + d2t.long()
        if int(target.min()) < 0 or int(target.max()) >= self.vocab_size:
            raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {self.vocab_size})")
        self.draft_to_target.copy_(target)

    def _load_embedding(self, weight: torch.Tensor) -> None:
        with torch.device(self.norm.weight.device):
            embedding = VocabEmbedding(self.vocab_size, self.config.hidden_size, dtype=self.norm.weight.dtype)
        embedding.weight_loader(embedding.weight, weight)
        self.embed_tokens = embedding

