"""Qwen3ForCausalLM against transformers on tiny random checkpoints (`rxf.testing.model_parity`):
logits of batched prefill, decode and a cached-prefix extend within 1e-4, and 24 greedy tokens
through the whole engine (batched, chunked prefill at 8, a second pass over cached prefixes).

Quirks in the configs: head_dim 32 with hidden 64 and 4 heads (hidden / heads = 16), GQA 4:2,
per-head q/k norms with weights drawn away from 1, tied embeddings, q/k/v/o biases, and a 16-token
window on one of the two layers (prompts of 40-118 tokens; the engine prefills them in chunks of 8).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rxf.plugins.models.qwen3 import Qwen3ForCausalLM
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import assert_logits_close, check_logits, check_runtime_greedy
from rxf.testing.reference import HFReference

VARIANTS = {
    "gqa-head_dim": {"head_dim": 32},
    # Layer 0 full, layer 1 a 16-token window (layers from max_window_layers on slide).
    "tied-bias-window": {"head_dim": 32, "tie_word_embeddings": True, "attention_bias": True,
                         "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
}
# 40-120 tokens, as the windowed variants of the other architectures use.
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((57, 40, 118))]


def variant_checkpoints(tmp_path_factory: pytest.TempPathFactory, arch: str, variants: dict[str, dict],
                        seed: int) -> dict[str, tuple[Path, HFReference]]:
    """Per variant: (tiny checkpoint of `arch` with its config overrides, transformers on it)."""
    out = {}
    for name, overrides in variants.items():
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{arch}-{name}"), arch, seed=seed, **overrides)
        out[name] = (path, HFReference(path))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, HFReference]]:
    return variant_checkpoints(tmp_path_factory, "Qwen3ForCausalLM", VARIANTS, seed=5)


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, checkpoints):
    return checkpoints[request.param]


def test_logits_match_transformers(checkpoint) -> None:
    path, ref = checkpoint
    check_logits(path, PROMPTS, reference=ref)


def test_runtime_greedy_matches_transformers(checkpoints) -> None:
    path, ref = checkpoints["tied-bias-window"]  # one engine per module: the one with the most quirks
    check_runtime_greedy(path, PROMPTS, chunk=8, new_tokens=24, reference=ref)


def test_window_is_per_layer(checkpoints) -> None:
    path, _ = checkpoints["tied-bias-window"]
    layers = ModelHarness(path).runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 16]


def test_head_norms_change_the_output(checkpoint) -> None:
    """The q/k norms matter: with them set to 1 (as if not loaded), logits leave the tolerance."""
    path, ref = checkpoint
    harness = ModelHarness(path)
    model = harness.runner.model
    assert isinstance(model, Qwen3ForCausalLM)
    for layer in model.model.layers:
        layer.self_attn.q_norm.weight.data.fill_(1.0)
        layer.self_attn.k_norm.weight.data.fill_(1.0)
    with pytest.raises(AssertionError):
        assert_logits_close(harness.prefill_logits(PROMPTS[:1])[0], ref.logits(PROMPTS[0]))


def test_norm_heads_in_place_normalises_each_head() -> None:
    """q heads with q_norm's weight, k heads with k_norm's, v untouched: the formula written out."""
    from rxf.plugins.models.layers import RMSNorm
    from rxf.plugins.models.layers.head_norm import norm_heads_

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, eps = 4, 2, 32, 1e-6
    q_norm, k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
    q_norm.weight.data = torch.randn(head_dim, generator=gen) * 0.3 + 1
    k_norm.weight.data = torch.randn(head_dim, generator=gen) * 0.3 + 1
    qkv = torch.randn(7, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    by_head = qkv.clone().unflatten(-1, (-1, head_dim))
    normed = by_head / by_head.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    weight = torch.stack([q_norm.weight] * heads + [k_norm.weight] * kv_heads + [torch.ones(head_dim)] * kv_heads)
    expected = torch.where(torch.arange(heads + 2 * kv_heads)[:, None] < heads + kv_heads, normed * weight, by_head)
    norm_heads_(qkv, q_norm, k_norm, heads, kv_heads, head_dim)
    torch.testing.assert_close(qkv, expected.flatten(-2), rtol=1e-5, atol=1e-5)
