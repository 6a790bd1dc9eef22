"""Gemma 2 and Gemma 3 (text) on tiny random checkpoints, against transformers (`model_parity`).

Each tiny config carries the architecture's quirks: local sliding-window layers (window 16) next to
global ones with prompts of 40-120 tokens, head_dim 32 != hidden / heads, GQA, tied embeddings,
`query_pre_attn_scalar`; Gemma 2 soft-caps attention scores and final logits, Gemma 3 normalises
q and k and rotates its global layers with another base and linear scaling.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from rxf.plugins.models.layers.norm import GemmaRMSNorm
from rxf.plugins.models.layers.rotary import rope_parameters
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import check_logits, check_runtime_greedy
from rxf.testing.reference import HFReference

# Gemma scales embeddings by sqrt(hidden): at the tiny default init (0.25) the newest token's embedding
# drowns its context and greedy tokens repeat; at 0.08 they vary (15-21 distinct tokens of 24).
COMMON = {"head_dim": 32, "tie_word_embeddings": True, "sliding_window": 16, "initializer_range": 0.08}
VARIANTS = {
    "gemma2": ("Gemma2ForCausalLM", {
        **COMMON, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
    "gemma3": ("Gemma3ForCausalLM", {
        **COMMON, "query_pre_attn_scalar": 32, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    }),
}
PROMPTS = [[(7 + 13 * i + 5 * (i % 7)) % 500 + 5 for i in range(n)] for n in (120, 75, 40)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=4, **overrides)
    return path, HFReference(path)


def test_logits_match_transformers(checkpoint) -> None:
    path, ref = checkpoint
    check_logits(path, PROMPTS, reference=ref, shared_prefix=100)  # prompt 0 (120 tokens): a cached prefix of many windows


def test_runtime_greedy_matches_transformers(checkpoint) -> None:
    path, ref = checkpoint
    check_runtime_greedy(path, PROMPTS, chunk=8, new_tokens=24, reference=ref)


@pytest.mark.parametrize(("context", "windows"), [(64, [16]), (16, [None])])
def test_served_context_sizes_rope_tables_and_windows(checkpoint, context, windows) -> None:
    """`model.context_length` sizes every rotary table; a window covering the whole context is none."""
    model = ModelHarness(checkpoint[0], **{"model.context_length": context}).runner.model
    attn = [layer.self_attn for layer in model.model.layers]
    assert {a.rotary_emb.cos_cache.shape[0] for a in attn} == {context}
    local = [a.attn.sliding_window for a, t in zip(attn, model.config.layer_types, strict=True) if t == "sliding_attention"]
    assert set(local) == set(windows)


def test_gemma_rmsnorm_rounds_like_transformers() -> None:
    """bfloat16: normalised and scaled by (1 + weight) in float32, rounded once (not Llama's order)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    ref = Gemma3RMSNorm(64, eps=1e-6)
    ref.weight.data.normal_(0.0, 0.5)
    ours = GemmaRMSNorm(64, 1e-6, torch.bfloat16)
    ours.weight.data.copy_(ref.weight.data)  # bf16 copy, as a bf16 checkpoint holds it
    ref.to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    residual = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(ours(x), ref(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, ref(x + residual))


def test_rope_per_layer_type_from_an_older_config(tmp_path) -> None:
    """transformers 4 wrote Gemma 3's rope as rope_theta + rope_local_base_freq + rope_scaling."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
    }))
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    local, full = rope_parameters(config, "sliding_attention"), rope_parameters(config, "full_attention")
    assert (local["rope_type"], local["rope_theta"]) == ("default", 10000.0)
    assert (full["rope_type"], full["rope_theta"], full["factor"]) == ("linear", 1000000.0, 8.0)
    with pytest.raises(ValueError, match="per layer type .* layer type None has none"):
        rope_parameters(config)
