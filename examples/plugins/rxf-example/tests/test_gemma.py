"""GemmaForCausalLM inside rxf against transformers' Gemma on tiny random checkpoints.

Fixtures come from rxf's pytest plugin (installed with rxf: no conftest needed).
"""

from __future__ import annotations

import pytest

from rxf.testing.reference import assert_logits_close

VARIANTS = {
    # head_dim 32 != hidden 64 / 4 heads, as in Gemma-7B; tied head, tanh GELU: the released models.
    "released": {"head_dim": 32, "tie_word_embeddings": True},
    # exact GELU (the first configs), q/k/v/o biases and an untied head: the loader's other paths.
    "variants": {"head_dim": 16, "hidden_act": "gelu", "attention_bias": True, "tie_word_embeddings": False},
}
PROMPTS = [[5, 80, 17, 300, 42, 9, 250, 11, 64, 3, 77], [400, 12], [99, 100, 101, 102, 103, 104]]


@pytest.fixture(params=list(VARIANTS))
def gemma(request, rxf_tiny_checkpoint):
    return rxf_tiny_checkpoint("GemmaForCausalLM", seed=3, **VARIANTS[request.param])


def test_prefill_logits_match_transformers(gemma, rxf_model_harness, rxf_hf_reference):
    ours = rxf_model_harness(gemma).prefill_logits(PROMPTS)
    for prompt, logits in zip(PROMPTS, ours, strict=True):
        assert_logits_close(logits, rxf_hf_reference(gemma).logits(prompt))


@pytest.mark.parametrize("backend", ["torch_native", "batched_sdpa"])
def test_greedy_tokens_match_transformers(gemma, backend, rxf_model_harness, rxf_hf_reference):
    ours = rxf_model_harness(gemma, attention_backend=backend).greedy(PROMPTS, 12)
    assert ours == [rxf_hf_reference(gemma).greedy(p, 12) for p in PROMPTS]
