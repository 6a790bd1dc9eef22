"""Mistral's and Qwen2's sliding windows against transformers: window 16, prompts of 40-120 tokens
(so every prompt, the decode steps and the cached-prefix extend reach past the window), and chunked
prefill at 8, a chunk smaller than the window, through the real scheduler.

Mistral windows every layer (head_dim 32 != hidden / heads, GQA); the Qwen2 checkpoint slides from
layer 1 on (`max_window_layers` 1: layer 0 is full attention) with tied embeddings.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_parity import check_logits, check_runtime_greedy
from rxf.testing.reference import HFReference

WINDOW = 16
CHECKPOINTS = {
    "mistral": ("MistralForCausalLM", {"sliding_window": WINDOW, "head_dim": 32}),
    "qwen2": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, "tie_word_embeddings": True},
    ),
}


def prompts(vocab: int = 512) -> list[list[int]]:
    return [[(5 + 7 * i + 3 * n) % vocab for i in range(n)] for n in (40, 77, 120)]


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFReference]:
    arch, overrides = CHECKPOINTS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    return path, HFReference(path)


def test_windowed_logits_match_transformers(checkpoint: tuple[Path, HFReference]) -> None:
    path, ref = checkpoint
    check_logits(path, prompts(), reference=ref)


def test_windowed_runtime_greedy_with_chunked_prefill(checkpoint: tuple[Path, HFReference]) -> None:
    path, ref = checkpoint
    check_runtime_greedy(path, prompts(), chunk=8, new_tokens=24, reference=ref)
