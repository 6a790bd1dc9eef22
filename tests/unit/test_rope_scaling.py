"""Rope scaling tables (`layers/rope_scaling.py`, `RotaryEmbedding`) against transformers' own rotary
embedding modules on the same configs: cos and sin, attention factor included, at every position.

The length-dependent types are compared where rxf's per-engine rule and transformers' per-call one
agree (see `rope_scaling.py`); the model-level checks are in test_rope_models.py and test_phi3.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from rxf.plugins.models.layers.rotary import RotaryEmbedding, rope_parameters, supported_context_length

HEAD_DIM = 32
LONG_FACTORS = [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)]  # one per rotated pair (sliced when partial)
SHORT_FACTORS = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]


def _llama(rope: dict[str, Any], max_pos: int = 64) -> Any:
    return AutoConfig.for_model(
        "llama", hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )


def _phi3(partial: float, max_pos: int = 256, original: int = 32) -> Any:
    n = int(HEAD_DIM * partial) // 2
    return AutoConfig.for_model(
        "phi3", hidden_size=4 * HEAD_DIM, num_attention_heads=4, partial_rotary_factor=partial,
        max_position_embeddings=max_pos, original_max_position_embeddings=original,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": SHORT_FACTORS[:n], "long_factor": LONG_FACTORS[:n]},
    )


def _reference(config: Any) -> torch.nn.Module:
    """transformers' rotary embedding for `config` (its modeling modules import triton, so they are
    imported here, not before test_triton_attention can set TRITON_INTERPRET)."""
    if config.model_type == "phi3":
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

        return Phi3RotaryEmbedding(config)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config)


def _theirs(module: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin for positions 0..length-1 in one forward call (first halves)."""
    cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _assert_tables(ours: RotaryEmbedding, module: torch.nn.Module, length: int) -> None:
    cos, sin = _theirs(module, length)
    torch.testing.assert_close(ours.cos_cache[:length], cos, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache[:length], sin, rtol=1e-5, atol=1e-6)


YARN_CASES = {
    # Qwen2.5's long-context recipe: factor 4 over the original window, default betas.
    "qwen2.5": {"factor": 4.0, "original_max_position_embeddings": 64},
    # DeepSeek-style mscale pair (attention factor = mscale ratio), gpt-oss-style truncate = false.
    "mscale": {"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 1.0},
    "no-truncate": {"factor": 32.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                    "truncate": False},
    "attention-factor": {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 0.8,
                         "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_transformers_at_every_position(case: str) -> None:
    config = _llama({"rope_type": "yarn", **YARN_CASES[case]})
    length = supported_context_length(config)
    params = YARN_CASES[case]
    assert length == max(64, int(params["original_max_position_embeddings"] * params["factor"]))
    ours = RotaryEmbedding(HEAD_DIM, length, rope_parameters(config), torch.float32)
    assert ours.cos_sin_cache is not None  # one table by position: backends may fuse it
    _assert_tables(ours, _reference(config), length)
    torch.testing.assert_close(ours.cos_sin_cache, torch.cat((ours.cos_cache, ours.sin_cache), -1))


def test_dynamic_is_unscaled_inside_the_trained_window_and_scaled_for_a_longer_context() -> None:
    config = _llama({"rope_type": "dynamic", "factor": 2.0}, max_pos=48)
    assert supported_context_length(config) == 96
    params = rope_parameters(config)
    # Served context <= max_position_embeddings: transformers never scales there.
    inside = RotaryEmbedding(HEAD_DIM, 48, params, torch.float32)
    _assert_tables(inside, _reference(config), 48)
    default = RotaryEmbedding(HEAD_DIM, 48, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)
    torch.testing.assert_close(inside.cos_cache, default.cos_cache)
    # Served context 96: the base transformers computes for a 96-token sequence, at every position.
    longer = RotaryEmbedding(HEAD_DIM, 96, params, torch.float32)
    _assert_tables(longer, _reference(config), 96)
    assert not torch.allclose(longer.cos_cache[:48], inside.cos_cache)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_long_factors_past_the_original_window(partial: float) -> None:
    config = _phi3(partial)
    params = rope_parameters(config)
    ours = RotaryEmbedding(HEAD_DIM, 256, params, torch.float32)  # context 256 > original 32: long
    # transformers picks the long factors for a call whose positions pass the original window.
    _assert_tables(ours, _reference(config), 100)
    assert ours.rotary_dim == int(HEAD_DIM * partial)
    # A partial rotation is not the whole-head table the backends' fused rope reads.
    assert (ours.cos_sin_cache is None) == (partial < 1)


def test_longrope_short_factors_when_the_context_fits_the_original_window() -> None:
    config = _phi3(1.0)
    ours = RotaryEmbedding(HEAD_DIM, 32, rope_parameters(config), torch.float32)  # model.context_length 32
    _assert_tables(ours, _reference(config), 32)
    long = RotaryEmbedding(HEAD_DIM, 256, rope_parameters(config), torch.float32)
    assert not torch.allclose(ours.cos_cache[1:32], long.cos_cache[1:32])


def test_partial_rotation_leaves_the_tail_of_each_head_alone() -> None:
    rope = RotaryEmbedding(8, 16, {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5})
    q, k = torch.randn(3, 2 * 8), torch.randn(3, 8)
    q2, k2 = rope(torch.tensor([0, 5, 9]), q.clone(), k.clone())
    torch.testing.assert_close(q2.view(3, 2, 8)[..., 4:], q.view(3, 2, 8)[..., 4:])
    torch.testing.assert_close(q2[0], q[0])  # position 0 rotates by nothing
    assert not torch.allclose(k2[1, :4], k[1, :4])


def test_legacy_spellings_and_bad_factor_lists() -> None:
    legacy = SimpleNamespace(
        rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
        rope_theta=10000.0, max_position_embeddings=128, original_max_position_embeddings=16,
    )
    params = rope_parameters(legacy)  # Phi-3's first configs called longrope "su"
    assert params["rope_type"] == "longrope"
    assert (params["max_position_embeddings"], params["original_max_position_embeddings"]) == (128, 16)
    with pytest.raises(ValueError, match="long_factor has 4 entries; the rotary dimension 16 needs 8"):
        RotaryEmbedding(16, 128, params)
    with pytest.raises(NotImplementedError, match="rope_type 'mrope' is not supported"):
        RotaryEmbedding(16, 128, {"rope_type": "mrope", "rope_theta": 1.0})
