"""Phi3ForCausalLM (Phi-3, Phi-4) against transformers (`rxf.testing.model_parity`, fp32,
torch_native): fused qkv_proj / gate_up_proj checkpoint tensors, longrope with positions past the
original window, partial rotary, tied embeddings, a 16-token sliding window under prompts of 40-120;
and the real Phi-4 / Phi-4-mini configs build and take their checkpoints' tensor names and shapes.

Tensor-parallel splitting of the fused tensors is checked in test_tp_models.py (two gloo ranks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig

from rxf.plugins.models.phi3 import Phi3ForCausalLM
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_parity import check_logits, check_runtime_greedy

ORIGINAL = 32  # original_max_position_embeddings of the tiny models: prompts run past it


def _longrope(pairs: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(pairs)], "long_factor": [1.0 + 1.5 * i for i in range(pairs)],
    }


def _prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def phi4_mini_like(tmp_path_factory: pytest.TempPathFactory):
    """Phi-4-mini's quirks: partial rotary, tied embeddings, GQA, longrope, a window longer than
    the context (262144 there)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("phi4-mini-like"), "Phi3ForCausalLM", seed=7, partial_rotary_factor=0.5,
        tie_word_embeddings=True, max_position_embeddings=256, original_max_position_embeddings=ORIGINAL,
        sliding_window=4096, rope_parameters=_longrope(4),
    )


def test_longrope_past_the_original_window(phi4_mini_like) -> None:
    # Context 256 > 32: long factors at every position, as transformers for sequences past 32.
    check_logits(phi4_mini_like, _prompts(40, 120, 75))


def test_greedy_through_the_runtime(phi4_mini_like) -> None:
    check_runtime_greedy(phi4_mini_like, _prompts(60, 100, seed=1), chunk=8, new_tokens=24)


def test_short_factors_when_the_context_fits_the_original_window(phi4_mini_like) -> None:
    check_logits(phi4_mini_like, _prompts(12, 25, seed=2), **{"model.context_length": ORIGINAL})


@pytest.fixture(scope="module")
def phi3_mini_like(tmp_path_factory: pytest.TempPathFactory):
    """Phi-3-mini's: every layer slides (its 4k model: 2047 of 4096 positions; here 16), full
    rotary, all heads with their own kv (no GQA), untied head; longrope as in its 128k model."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("phi3-mini-like"), "Phi3ForCausalLM", seed=8, num_key_value_heads=4,
        max_position_embeddings=512, original_max_position_embeddings=ORIGINAL, sliding_window=16,
        rope_parameters=_longrope(8),
    )


def test_sliding_window_and_longrope(phi3_mini_like) -> None:
    # Prompts of 40-120 tokens over a 16-token window; the cached-prefix extend reads past it too.
    check_logits(phi3_mini_like, _prompts(50, 110, 40, seed=3))


def test_sliding_window_greedy_with_chunks_smaller_than_it(phi3_mini_like) -> None:
    check_runtime_greedy(phi3_mini_like, _prompts(45, 90, seed=4), chunk=8, new_tokens=24)


def test_a_window_as_long_as_the_context_served_is_no_window() -> None:
    config = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                  vocab_size=512, max_position_embeddings=64, sliding_window=16)
    assert Phi3ForCausalLM(config).model.layers[0].self_attn.attn.sliding_window == 16
    assert Phi3ForCausalLM(config, context_length=16).model.layers[0].self_attn.attn.sliding_window is None


# The real configs' shapes (config.json of microsoft/phi-4 and microsoft/Phi-4-mini-instruct).
PHI4 = {
    "hidden_size": 5120, "intermediate_size": 17920, "num_attention_heads": 40, "num_hidden_layers": 40,
    "num_key_value_heads": 10, "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
    "rope_theta": 250000.0, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 100352,
}
PHI4_MINI = {
    "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75, "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 200064,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
}


@pytest.mark.parametrize(("fields", "context", "rotary_dim"), [(PHI4, 16384, 128), (PHI4_MINI, 131072, 96)])
def test_real_phi4_configs_build_and_load_their_tensor_names(fields, context, rotary_dim) -> None:
    """On the meta device (no memory): transformers' Phi3ForCausalLM holds the checkpoint's names and
    shapes (fused qkv_proj / gate_up_proj; Phi-4-mini stores no lm_head), which ours must load."""
    from transformers import Phi3ForCausalLM as HFPhi3ForCausalLM  # imports triton: not at collection
    config = AutoConfig.for_model("phi3", architectures=["Phi3ForCausalLM"], **fields)
    assert Phi3ForCausalLM.max_context_length(config) == context
    with torch.device("meta"):
        ours = Phi3ForCausalLM(config, dtype=torch.bfloat16, context_length=context)
        checkpoint = HFPhi3ForCausalLM(config).state_dict()
    if config.tie_word_embeddings:
        checkpoint.pop("lm_head.weight", None)
    assert "model.layers.0.self_attn.qkv_proj.weight" in checkpoint
    ours.load_weights(checkpoint.items())  # raises on any unmatched name or shape
    rotary = ours.model.layers[0].self_attn.rotary_emb
    assert rotary.rotary_dim == rotary_dim and rotary.cos_cache.shape == (context, rotary_dim // 2)
