"""Llama-family decoder-only models over the paged KV pool: Llama 2/3, Mistral, Qwen2.

Parameter names follow the Hugging Face checkpoints (`model.layers.{i}.self_attn...`), except that q/k/v
are fused into `qkv_proj` and gate/up into `gate_up_proj`; `load_weights` maps the names.
The forward consumes a `ForwardBatch` whose tokens are flattened over requests (no padding), and
returns float32 logits for the rows in `batch.logits_indices` only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
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
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    rope_parameters,
)
from rxf.plugins.models.layers.rotary import supported_context_length

logger = logging.getLogger(__name__)

_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def head_dim_of(config: Any) -> int:
    """Explicit `head_dim` when the checkpoint sets one (it may differ from hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = config.intermediate_size
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, dtype=dtype)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, dtype=dtype)
        # Where the decode GEMV serves gate_up (`layers/gemv.py`), small batches get it and SiLU·mul in one launch.
        self.gate_up_act = self.gate_up_proj.decode_gemv("gate_up_proj", gated=True)
        self.down_proj.use_decode_gemv("down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_act is not None and self.gate_up_act.applies(x):
            return self.down_proj(self.gate_up_act(x, self.gate_up_proj.weight, self.gate_up_proj.bias))
        if (activated := self.gate_up_proj.forward_activated(x, self.act)) is not None:  # a quantized GEMV's
            return self.down_proj(activated)
        return self.down_proj(self.gate_up_proj(x), act=self.act)

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`forward(norm(h + residual))`, `h + residual`) with the add and the norm inside a quantized
        gate/up's input pass (`apply_normed`); None where that does not apply."""
        fused = self.gate_up_proj.forward_normed(h, residual, norm)
        if fused is None:
            return None
        gate_up, residual = fused
        return self.down_proj(gate_up, act=self.act), residual


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        qkv_bias: bool,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, dtype=dtype
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, config.hidden_size, getattr(config, "attention_bias", False), dtype=dtype
        )
        self.rotary_emb = rotary_emb  # one instance shared by all layers (its tables are large)
        # Per-rank sizes of the q | k | v split of the fused projection's output.
        self.qkv_sizes = [s * head_dim for s in (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads)]
        self.qkv_sizes.append(self.qkv_sizes[1])
        self.attn = RadixAttention(
            layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, sliding_window=sliding_window
        )
        self.qkv_proj.use_decode_gemv("qkv_proj")
        self.o_proj.use_decode_gemv("o_proj")

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), batch)

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`forward(norm(h + residual))`, `h + residual`) with the add and the norm inside a quantized
        qkv's input pass (`apply_normed`); None where that does not apply."""
        fused = self.qkv_proj.forward_normed(h, residual, norm)
        if fused is None:
            return None
        qkv, residual = fused
        return self.attend(qkv, batch), residual

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The block's output from its fused q | k | v projection."""
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        # The backend rotates q and k inside its K/V store where it can (one launch per layer).
        return self.o_proj(self.attn(q, k, v, batch, rotary=self.rotary_emb))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        qkv_bias: bool,
        rotary_emb: RotaryEmbedding,
        dtype: torch.dtype,
        mlp_cls: Callable[[Any, torch.dtype], nn.Module] = LlamaMLP,
        sliding_window: int | None = None,
        attn_cls: type[LlamaAttention] = LlamaAttention,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = attn_cls(config, layer_id, qkv_bias, rotary_emb, dtype, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = mlp_cls(config, dtype)  # the feed-forward block: dense, or mixture of experts

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm blocks; the residual stream is carried separately so each norm fuses its add.
        # Each block may take the residual add and its norm into its first launch (`forward_normed`:
        # a quantized qkv or gate/up's input pass, MixtralMoE's routing); None: it does not here, and
        # the norm runs as its own launch.
        if residual is None:  # first layer: the residual stream starts as the embeddings
            residual = x
            x = self.self_attn(self.input_layernorm(x), batch)
        elif (out := self.self_attn.forward_normed(x, residual, self.input_layernorm, batch)) is not None:
            x, residual = out
        else:
            x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(x, batch)
        forward_normed = getattr(self.mlp, "forward_normed", None)
        if forward_normed is not None and (out := forward_normed(x, residual, self.post_attention_layernorm)) is not None:
            return out
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    # EAGLE-3 (`LlamaForCausalLM.capture_aux_hidden_states`): layers whose inputs a forward also returns.
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        config: Any,
        qkv_bias: bool,
        dtype: torch.dtype,
        mlp_cls: Callable[[Any, torch.dtype], nn.Module] = LlamaMLP,
        sliding_windows: list[int | None] | None = None,
        attn_cls: type[LlamaAttention] = LlamaAttention,
        context_length: int | None = None,
    ) -> None:
        """`sliding_windows[i]`: layer i's window (None: full attention; default: none anywhere);
        `context_length`: the longest sequence served (default: the checkpoint's)."""
        super().__init__()
        windows = sliding_windows or [None] * config.num_hidden_layers
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype)
        # cos/sin for every position served: e.g. 131072 x 128 per table for Llama 3.1, so built once.
        rotary_emb = RotaryEmbedding(
            head_dim_of(config), context_length or supported_context_length(config), rope_parameters(config), dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, rotary_emb, dtype, mlp_cls, windows[i], attn_cls)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual stream, before the final norm (which the caller
        applies only to the rows whose logits it needs). `input_embeds` ([num_tokens, hidden])
        replaces the token embeddings (multimodal models write vision features into them)."""
        x = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        residual = None
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:  # layer i's input (a copy: the layers' fused norms work in place)
                aux[i] = x.clone() if residual is None else x + residual
            x, residual = layer(x, residual, batch)
        if aux:
            batch.aux_hidden = torch.cat([aux[i] for i in self.aux_hidden_layers], dim=-1)
        assert residual is not None, "a model has at least one layer"
        return x, residual


def final_hidden_states(decoder: nn.Module, batch: ForwardBatch, input_embeds: torch.Tensor | None) -> torch.Tensor:
    """The final hidden states (the final norm applied) of the rows in `batch.logits_indices` only,
    `[n, hidden]` in the model's dtype, from a decoder stack that returns (output, residual) before
    its final fused add-norm `decoder.norm`."""
    x, residual = decoder(batch, input_embeds)
    # (Decode rows too: an extend run as decode rows asks for some rows' logits only.)
    x, residual = x[batch.logits_indices], residual[batch.logits_indices]
    x, _ = decoder.norm(x, residual)
    return x


def _effective_window(window: int | None, served: int) -> int | None:
    """A window that covers every position served (`served` tokens of context) is no window (None
    keeps backends on their plain path)."""
    if window is None or int(window) >= served:
        return None
    return int(window)


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False  # Llama and Mistral: bias only when `attention_bias` says so
    mlp_cls: Callable[[Any, torch.dtype], nn.Module] = LlamaMLP  # each layer's feed-forward block
    attn_cls: type[LlamaAttention] = LlamaAttention  # each layer's attention block

    @classmethod
    def max_context_length(cls, config: Any) -> int:
        """The longest context this checkpoint serves (its rope scaling may extend
        max_position_embeddings); the runner then builds the model with `context_length=`."""
        return supported_context_length(config)

    def __init__(self, config: Any, dtype: torch.dtype | None = None, context_length: int | None = None) -> None:
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        self.config = config
        qkv_bias = getattr(config, "attention_bias", False) or self.qkv_bias_default
        served = context_length or supported_context_length(config)
        windows = [_effective_window(w, served) for w in self.sliding_windows(config)]
        self.model = LlamaModel(config, qkv_bias, dtype, self.mlp_cls, windows, self.attn_cls, served)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LogitsHead(config.vocab_size, config.hidden_size, dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head.use_decode_gemv()

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """Each layer's sliding window as Hugging Face's model applies it. Llama configs have none;
        Mistral and Mixtral give every layer `sliding_window` (null in most of their checkpoints)."""
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

    def forward(self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits `[len(batch.logits_indices), vocab]`."""
        return self.lm_head(self.hidden_states(batch, input_embeds))

    def hidden_states(self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """What the logits head reads, and what an embedding model pools (`model.task = "embed"`
        calls this instead of `forward`): `final_hidden_states`."""
        return final_hidden_states(self.model, batch, input_embeds)

    def capture_aux_hidden_states(self, layer_ids: tuple[int, ...]) -> None:
        """EAGLE-3: every forward also sets `batch.aux_hidden` to the inputs of layers `layer_ids`
        (transformers' `hidden_states[i]`; 0 is the embeddings) of every token it computes,
        concatenated in that order: `[num_tokens, len(layer_ids) * hidden]`."""
        layers = len(self.model.layers)
        if not layer_ids or any(not 0 <= i < layers for i in layer_ids):
            raise ValueError(f"auxiliary hidden-state layers {list(layer_ids)} must lie in [0, {layers})")
        self.model.aux_hidden_layers = tuple(layer_ids)

    def input_embeddings(self) -> VocabEmbedding:
        """The token embedding (an EAGLE-3 head without its own reads it)."""
        return self.model.embed_tokens

    def _skip(self, name: str) -> bool:
        # Old checkpoints store rotary inv_freq buffers; tied checkpoints may still store the head.
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, stacked=_STACKED, skip=self._skip)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's module structure plus a sliding window on every layer (`sliding_windows`)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True  # Qwen2 always has q/k/v biases (and none on o_proj)

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        """`layer_types` decides per layer: transformers 5 fills it from `use_sliding_window` and
        `max_window_layers` (layers from max_window_layers on slide) when a config.json lacks it, and
        clears `sliding_window` when use_sliding_window is false."""
        window = config.sliding_window
        return [window if kind == "sliding_attention" else None for kind in config.layer_types]
