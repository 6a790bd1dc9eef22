"""rxf's pytest plugin as rxf's own suite sees it: registered through the `pytest11` entry point,
its fixtures check a builtin model against transformers. (The example plugin's suite uses all of
them, `rxf_runtime` included, from a fresh environment: test_plugin_example_install.py.)"""

from __future__ import annotations

import subprocess
import sys

import torch

import rxf.testing.pytest_plugin
from rxf.testing.reference import assert_logits_close

PROMPTS = [[5, 80, 17, 300, 42, 9], [400, 12, 7]]


def test_registered_through_the_pytest11_entry_point(request):
    assert request.config.pluginmanager.get_plugin("rxf") is rxf.testing.pytest_plugin


def test_checkpoints_are_cached_per_arguments(rxf_tiny_checkpoint):
    a = rxf_tiny_checkpoint("Qwen2ForCausalLM", tie_word_embeddings=True)
    assert rxf_tiny_checkpoint("Qwen2ForCausalLM", tie_word_embeddings=True) == a
    assert rxf_tiny_checkpoint("Qwen2ForCausalLM", seed=1, tie_word_embeddings=True) != a
    assert (a / "config.json").is_file() and (a / "model.safetensors").is_file()


def test_harness_matches_the_reference(rxf_tiny_checkpoint, rxf_model_harness, rxf_hf_reference):
    path = rxf_tiny_checkpoint("Qwen2ForCausalLM", tie_word_embeddings=True)
    harness, ref = rxf_model_harness(path), rxf_hf_reference(path)
    assert rxf_model_harness(path) is harness
    for prompt, logits in zip(PROMPTS, harness.prefill_logits(PROMPTS), strict=True):
        assert logits.dtype == torch.float32 and logits.shape == (len(prompt), 512)
        assert_logits_close(logits, ref.logits(prompt))
    assert harness.greedy(PROMPTS, 10) == [ref.greedy(p, 10) for p in PROMPTS]


def test_loading_the_pytest_plugin_imports_neither_torch_nor_transformers():
    # pytest loads it in every run in the environment, including suites that never touch rxf.
    code = "import sys, rxf.testing.pytest_plugin; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
