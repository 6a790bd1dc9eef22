"""Rotary position embeddings (NeoX "rotate-half" layout, as Hugging Face Llama uses).

The cos/sin tables are precomputed for every position up to `max_position` and indexed by
`batch.positions`, so the forward is a gather plus elementwise math: no data-dependent branching,
which keeps the decode path capturable by CUDA graphs. On CUDA in fp16/bf16 with flashinfer, one
fused kernel rotates q and k in place from a float32 cos|sin table. The same table
(`cos_sin_cache`, `rxf.core.attention.Rotary`) lets an attention backend fold the rotation into its
K/V store: models pass this module to `RadixAttention` rather than calling it.

Scaled ropes (`rope_scaling.py`: yarn, dynamic NTK, longrope, linear, llama3) are still one table
indexed by position: their angle rates are fixed per engine, and their attention factor multiplies
cos and sin. A partial rotation (`partial_rotary_factor` < 1: the first `rotary_dim` features of each
head rotate, the rest pass through) is not the whole-head rotation backends fuse, so its
`cos_sin_cache` is None.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rxf.plugins.models.layers.fused_kernels import flashinfer_for
from rxf.plugins.models.layers.rope_scaling import (
    attention_factor,
    inverse_frequencies,
    scaled_context_length,
)

# The config fields, besides `rope_parameters` itself, that each scaling's formulas read.
_TRAINED_LENGTH_TYPES = ("yarn", "dynamic", "longrope")
_ORIGINAL_LENGTH_TYPES = ("yarn", "longrope", "llama3")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The checkpoint's rope settings as one flat dict with at least `rope_type` and `rope_theta`;
    for yarn, dynamic and longrope also the checkpoint's `max_position_embeddings`, and
    `original_max_position_embeddings` where the type uses it.

    transformers 5 keeps them in `config.rope_parameters`; older configs have `rope_theta` plus an
    optional `rope_scaling` dict (whose type key was once spelled `type`, and longrope once `su`).
    Models whose layer types rotate differently (Gemma 3: local layers at base 10k, global ones at
    1M with linear scaling) hold one such dict per `layer_type` ("sliding_attention",
    "full_attention"); transformers 5 builds them from older configs' `rope_local_base_freq`.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if any(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            raise ValueError(
                f"rope parameters are given per layer type ({', '.join(sorted(params))}); "
                f"layer type {layer_type!r} has none"
            )
        params = params[layer_type]
    out = dict(params)
    rope_type = out.get("rope_type") or out.pop("type", None) or "default"
    out["rope_type"] = "longrope" if rope_type == "su" else rope_type
    out.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if getattr(config, "partial_rotary_factor", None) is not None:
        out.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    if out["rope_type"] in _TRAINED_LENGTH_TYPES:
        out.setdefault("max_position_embeddings", int(config.max_position_embeddings))
    if out["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        original = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
        out.setdefault("original_max_position_embeddings", int(original))
    return out


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading features of each head rotate (transformers: int(head_dim * factor))."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def supported_context_length(config: Any) -> int:
    """The longest context a checkpoint's rope is made for (`scaled_context_length`): what
    `model.context_length` may ask for, and its default."""
    return scaled_context_length(rope_parameters(config), int(config.max_position_embeddings))


class RotaryEmbedding(nn.Module):
    """Rotates q and k (`[num_tokens, heads * head_dim]`) by their tokens' absolute positions, for
    positions below `max_position`: the longest context the engine serves, which also fixes the
    length-dependent scalings (`rope_scaling.py`).

    The fused path rotates q and k in place (they are views into the qkv projection's output, used
    by nobody else), so callers keep only the returned tensors.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary dimension {self.rotary_dim} of head_dim {head_dim}: must be even, > 0, <= head_dim")
        inv_freq = inverse_frequencies(self.rotary_dim, params, max_position)
        # Angles in float32 (as the reference does), scaled and cast to the model dtype once here.
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.to(torch.float32))
        scale = attention_factor(params)
        cos, sin = angles.cos() * scale, angles.sin() * scale
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos_cache", cos.to(dtype), persistent=False)
        self.register_buffer("sin_cache", sin.to(dtype), persistent=False)
        # The fused kernels' table (FlashInfer's layout): float32 [max_position, head_dim], cos in the
        # first half, sin in the second; max_position * head_dim * 4 bytes (64 MB for Llama 3.1).
        # None for a partial rotation (`rxf.core.attention.Rotary`).
        table = torch.cat((cos, sin), dim=-1) if self.rotary_dim == head_dim else None
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (-1, self.head_dim))
        rot, rest = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        x1, x2 = rot.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).flatten(-2)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1 (broadcast over heads), half]
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fi = flashinfer_for(q)
        if (
            fi is None
            or self.cos_sin_cache is None  # a partial rotation: the torch code handles it
            or k.dtype != q.dtype
            or q.stride(-1) != 1
            or k.stride(-1) != 1
        ):
            return self.forward_native(positions, q, k)
        fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, self.head_dim, self.cos_sin_cache, is_neox=True
        )
        return q, k
