"""Rotary position embeddings (NeoX "rotate-half" layout, as Hugging Face Llama uses).

The cos/sin tables are precomputed for every position up to `max_position` and indexed by
`batch.positions`, so the forward is a gather plus elementwise math: no data-dependent branching,
which keeps the decode path capturable by CUDA graphs. On CUDA in fp16/bf16 with flashinfer, one
fused kernel rotates q and k in place from a float32 cos|sin table. The same table
(`cos_sin_cache`, `rxf.core.attention.Rotary`) lets an attention backend fold the rotation into its
K/V store: models pass this module to `RadixAttention` rather than calling it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rxf.plugins.models.layers.fused_kernels import flashinfer_for

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The checkpoint's rope settings as one flat dict with at least `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`; older configs have `rope_theta` plus an
    optional `rope_scaling` dict (whose type key was once spelled `type`). Models whose layer types
    rotate differently (Gemma 3: local layers at base 10k, global ones at 1M with linear scaling)
    hold one such dict per `layer_type` ("sliding_attention", "full_attention"); transformers 5
    builds them from older configs' `rope_local_base_freq`.
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
    out["rope_type"] = out.get("rope_type") or out.pop("type", None) or "default"
    out.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: wavelengths longer than the original context / low_freq_factor are
    stretched by `factor`, shorter than original / high_freq_factor are kept, and the band in between
    is interpolated linearly in 1/wavelength."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, interpolated, scaled)


def inverse_frequencies(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """float32 [rotary_dim // 2]: the angle per position of each rotated pair."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    """Rotates q and k (`[num_tokens, heads * head_dim]`) by their tokens' absolute positions.

    The fused path rotates q and k in place (they are views into the qkv projection's output, used
    by nobody else), so callers keep only the returned tensors.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, params)
        # Angles in float32 (as the reference does), tables cast to the model dtype once here.
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.to(torch.float32))
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("cos_cache", angles.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", angles.sin().to(dtype), persistent=False)
        # The fused kernels' table (FlashInfer's layout): float32 [max_position, head_dim], cos in the
        # first half, sin in the second; max_position * head_dim * 4 bytes (64 MB for Llama 3.1).
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(-1, (-1, self.head_dim))
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

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
        if fi is None or k.dtype != q.dtype or q.stride(-1) != 1 or k.stride(-1) != 1:
            return self.forward_native(positions, q, k)
        fi.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, self.head_dim, self.cos_sin_cache, is_neox=True
        )
        return q, k
