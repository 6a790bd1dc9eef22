"""The CPU decode forward compiled whole (`rxf.core.runner.compiled_decode`), which serves extends
as rows too: logits against transformers, greedy tokens against the eager forward and transformers
through `Runtime`, and no compile after the warm-up whatever the batch size, key count or extend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rxf.core.runner.startup import cpu_has_native_bf16
from rxf.plugins.attention.cpu import COMPILE_ENV
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import check_logits, check_runtime_greedy

COMPILED = {"runtime.cpu_compile": "startup"}


@pytest.fixture(autouse=True)
def kernels_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "startup")


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # GQA, a sliding window on every layer: the window's first visible key is computed in the graph.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mistral"), "MistralForCausalLM", seed=3, sliding_window=16)


def prompts(vocab: int = 512) -> list[list[int]]:
    return [[(5 + 7 * i + 3 * n) % vocab for i in range(n)] for n in (40, 9, 77)]


def test_compiled_decode_logits_match_transformers(tiny_mistral: Path) -> None:
    check_logits(tiny_mistral, prompts(), attention_backend="cpu", decode_steps=4, **COMPILED)


def test_compiled_decode_is_the_eager_decode_and_never_compiles_again(
    tiny_mistral: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens equal the eager forwards', and after the warm-up no forward needs another graph
    (a guard failure raises here instead of running eagerly): decode at batch 1 and more, and the
    prompts' extends as rows, of one request (a 2-token prompt too) or several, of one row each."""
    from rxf.core.runner.compiled_decode import CompiledDecode

    # Both counts a 2-core machine's CpuThreads chooses between (torch.compile guards on the count).
    counts = (1, 2)
    # The dtype the engine serves a bf16 checkpoint in on this CPU (`startup.resolve_dtype`). Where bf16
    # is emulated (no AVX512-BF16 / AMX) Inductor's fused code rounds to bf16 at other points than the
    # eager ops, and greedy tokens of the random tiny model part at a near-tie; in float32 they agree.
    dtype = {"model.dtype": "bfloat16" if cpu_has_native_bf16() else "float32"}
    compiled = ModelHarness(tiny_mistral, "cpu", thread_counts=counts, **dtype, **COMPILED)
    assert all(compiled.runner.compiled_decode.ready_for(n) for n in counts)
    eager = ModelHarness(tiny_mistral, "cpu", **dtype)
    assert eager.runner.compiled_decode is None
    monkeypatch.setattr(CompiledDecode, "on_guard_failure", "fail_on_recompile")
    saved = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            for batch in ([prompts()[1]], [[7, 9]], prompts()[:2], prompts(), [[5], [6], [7]]):
                assert compiled.greedy(batch, 12) == eager.greedy(batch, 12)
    finally:
        torch.set_num_threads(saved)


def test_runtime_greedy_through_the_compiled_decode(tiny_mistral: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RXF_RUNTIME__CPU_COMPILE", raising=False)  # (tests/conftest.py: it outranks a dict config)
    check_runtime_greedy(tiny_mistral, prompts(), chunk=8, new_tokens=16, attention={"backend": "cpu"},
                         runtime={"cpu_compile": "startup"})


def test_no_compiled_decode_where_it_cannot_apply(tiny_mistral: Path) -> None:
    assert ModelHarness(tiny_mistral, "torch_native", **COMPILED).runner.compiled_decode is None  # not traceable
    assert ModelHarness(tiny_mistral, "cpu").runner.compiled_decode is None  # the harness's default: off
    with torch.inference_mode():
        assert ModelHarness(tiny_mistral, "cpu").greedy([prompts()[1]], 4)
