"""`hidden_states` of the model classes that serve embeddings (`model.task = "embed"`): every
position's final hidden state (the final norm applied) of a batched prefill in rxf's ModelRunner,
against transformers' base model (`last_hidden_state`) on the same tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.reference import HFReference

ARCHS = {
    "LlamaForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 32, "tie_word_embeddings": True},
    "Gemma2ForCausalLM": {"head_dim": 32, "initializer_range": 0.08, "final_logit_softcapping": 3.0},
    "Gemma3ForCausalLM": {"head_dim": 32, "initializer_range": 0.08, "query_pre_attn_scalar": 32},
}
PROMPTS = [[(11 * i + 3) % 500 + 5 for i in range(n)] for n in (37, 12)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hidden_states_match_transformers(arch, tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, seed=2, **ARCHS[arch])
    ours = ModelHarness(path, **{"model.task": "embed"}).prefill_logits(PROMPTS)  # hidden states, no logits
    ref = HFReference(path)
    for prompt, states in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            expected = ref.model.model(torch.tensor([prompt])).last_hidden_state[0].float()
        assert states.shape == expected.shape
        torch.testing.assert_close(states.float(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
