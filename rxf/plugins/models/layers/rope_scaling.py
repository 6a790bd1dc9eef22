"""Rope scaling: the per-pair angle rates (inverse frequencies) and the cos/sin factor of each
`rope_type` a Hugging Face config may name, as transformers 5 defines them.

`params` is the flat dict of `rotary.rope_parameters(config)`. Two types depend on the sequence
length in transformers, which picks their tables per forward call from the longest position in it;
a serving engine cannot re-rotate keys already in the KV cache, so rxf fixes the choice once per
engine from `context_length`, the longest context it serves (`model.context_length`, default the
checkpoint's `max_context_length`):

- `longrope` (Phi-3's "su"): the long factors for every position when `context_length` exceeds
  `original_max_position_embeddings`, else the short factors (vLLM's rule). transformers agrees
  wherever the whole sequence of a forward call lies on the same side of the original window:
  always when the context fits inside it; otherwise for sequences longer than the window, while it
  rotates shorter ones with the short factors.
- `dynamic` (NTK): the base transformers computes for a sequence of `context_length` tokens, at every
  position. Up to the checkpoint's `max_position_embeddings` that is the unscaled base, so a context
  that fits it matches transformers everywhere; a longer context (up to `factor` times it) matches
  transformers for a sequence of exactly that length, while shorter ones get a smaller base there.

`yarn`, `linear` and `llama3` do not depend on the length: one table for every position, as in
transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def _wavelength_steps(rotary_dim: int, base: float) -> torch.Tensor:
    """float32 [rotary_dim // 2]: base ** (2j / rotary_dim), the unscaled positions per radian of
    pair j. Scalings divide by it times their factor, in that order (as transformers rounds)."""
    return base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)


def _base_rates(rotary_dim: int, base: float) -> torch.Tensor:
    """float32 [rotary_dim // 2]: the unscaled angle per position of each pair."""
    return 1.0 / _wavelength_steps(rotary_dim, base)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
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


def _scaling_factor(params: dict[str, Any]) -> float:
    """yarn's and longrope's `factor`; Phi-3 and DeepSeek configs leave it out, meaning the ratio of
    the extended to the original context."""
    factor = params.get("factor")
    if factor is None:
        return params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return float(factor)


def _yarn(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN: pairs that turn more than `beta_fast` times over the original context keep their rate
    (extrapolation), pairs that turn fewer than `beta_slow` times are divided by `factor`
    (interpolation), and a linear ramp over pair index joins the two."""
    base = float(params["rope_theta"])
    factor = _scaling_factor(params)
    original = params["original_max_position_embeddings"]
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if params.get("truncate", True):  # gpt-oss sets truncate = false
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    steps = _wavelength_steps(rotary_dim, base)
    extrapolation, interpolation = 1.0 / steps, 1.0 / (factor * steps)
    keep = 1 - ramp  # 1 where the rate is kept, 0 where it is interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _dynamic_base(rotary_dim: int, params: dict[str, Any], context_length: int) -> float:
    trained = params["max_position_embeddings"]
    factor = float(params["factor"])
    length = max(context_length, trained)  # never below the trained length: no scaling inside it
    growth = (factor * length / trained) - (factor - 1)
    return float(params["rope_theta"]) * growth ** (rotary_dim / (rotary_dim - 2))


def _longrope(rotary_dim: int, params: dict[str, Any], context_length: int) -> torch.Tensor:
    long = context_length > params["original_max_position_embeddings"]
    name = "long_factor" if long else "short_factor"
    factors = params[name]
    if len(factors) != rotary_dim // 2:
        raise ValueError(
            f"rope_parameters.{name} has {len(factors)} entries; the rotary dimension {rotary_dim} "
            f"needs {rotary_dim // 2}"
        )
    steps = _wavelength_steps(rotary_dim, float(params["rope_theta"]))
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * steps)


def inverse_frequencies(rotary_dim: int, params: dict[str, Any], context_length: int | None = None) -> torch.Tensor:
    """float32 [rotary_dim // 2]: the angle per position of each rotated pair, for an engine that
    serves `context_length` tokens (default: the checkpoint's `max_position_embeddings`)."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if rope_type == "default":
        return _base_rates(rotary_dim, base)
    if rope_type == "linear":
        return _base_rates(rotary_dim, base) / float(params["factor"])
    if rope_type == "llama3":
        return _llama3(_base_rates(rotary_dim, base), params)
    if rope_type == "yarn":
        return _yarn(rotary_dim, params)
    if rope_type in ("dynamic", "longrope"):
        length = context_length or int(params["max_position_embeddings"])
        if rope_type == "dynamic":
            return _base_rates(rotary_dim, _dynamic_base(rotary_dim, params, length))
        return _longrope(rotary_dim, params, length)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    )


def attention_factor(params: dict[str, Any]) -> float:
    """The factor cos and sin are multiplied by (so attention logits by its square): yarn's and
    longrope's `attention_factor`, or the value their papers derive from the scaling factor."""
    rope_type = params["rope_type"]
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _scaling_factor(params)
    if rope_type == "yarn":
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        return _mscale(factor)
    original = params["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def scaled_context_length(params: dict[str, Any], max_position_embeddings: int) -> int:
    """The longest context the checkpoint's rope scaling is made for: yarn's original context times
    its factor (Qwen2.5 configs keep `max_position_embeddings` at the original 32768), dynamic's
    `factor` times the trained length, else `max_position_embeddings`."""
    rope_type = params["rope_type"]
    if rope_type == "yarn" and params.get("factor") is not None:
        scaled = int(params["original_max_position_embeddings"] * float(params["factor"]))
        return max(max_position_embeddings, scaled)
    if rope_type == "dynamic":
        return max(max_position_embeddings, int(max_position_embeddings * float(params["factor"])))
    return max_position_embeddings
