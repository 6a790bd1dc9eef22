"""Scaled ropes through whole models (`rxf.testing.model_parity`, fp32, torch_native): yarn on a
Qwen2.5-style long-context config and dynamic NTK on Llama, with positions past the original window.

Tiny configs: 2 layers, hidden 64, head_dim 32 (not hidden / heads), GQA 4 / 2, vocab 512.
"""

from __future__ import annotations

import pytest
import torch

from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import assert_logits_close, check_logits, check_runtime_greedy
from rxf.testing.reference import HFReference

ORIGINAL = 64  # the window the tiny models were "trained" for; prompts run to 120 tokens past it


def _prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def yarn_qwen2(tmp_path_factory: pytest.TempPathFactory):
    # Qwen2.5's recipe: max_position_embeddings stays the original window, rope_scaling stretches it.
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("yarn-qwen2"), "Qwen2ForCausalLM", seed=5, head_dim=32,
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": ORIGINAL},
    )


def test_yarn_logits_past_the_original_window(yarn_qwen2) -> None:
    # model.context_length defaults to original x factor = 256, beyond max_position_embeddings.
    check_logits(yarn_qwen2, _prompts(40, 120, 90))


def test_yarn_greedy_through_the_runtime(yarn_qwen2) -> None:
    check_runtime_greedy(yarn_qwen2, _prompts(70, 100, seed=1), chunk=8, new_tokens=24)


def test_context_length_beyond_the_scaled_window_is_refused(yarn_qwen2) -> None:
    with pytest.raises(ValueError, match="model.context_length 257 exceeds the 256 tokens the checkpoint supports"):
        ModelHarness(yarn_qwen2, **{"model.context_length": 257})


@pytest.fixture(scope="module")
def dynamic_llama(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("dynamic-llama"), "LlamaForCausalLM", seed=6, head_dim=32,
        max_position_embeddings=ORIGINAL, tie_word_embeddings=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )


def test_dynamic_inside_the_trained_window_is_transformers_exactly(dynamic_llama) -> None:
    # Serving at most max_position_embeddings: transformers never rescales there, nor does rxf.
    check_logits(dynamic_llama, _prompts(40, 56, 20), **{"model.context_length": ORIGINAL})


def test_dynamic_for_a_longer_context(dynamic_llama) -> None:
    # Default context = factor x 64 = 128: the NTK base of a 128-token sequence at every position,
    # which is what transformers uses for a 128-token forward call.
    harness = ModelHarness(dynamic_llama)
    assert harness.runner.max_context_len == 2 * ORIGINAL
    (prompt,) = _prompts(2 * ORIGINAL, seed=2)
    (ours,) = harness.prefill_logits([prompt])
    assert_logits_close(ours, HFReference(dynamic_llama).logits(prompt))
