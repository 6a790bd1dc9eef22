"""rxf's pytest plugin (entry point `pytest11: rxf`): fixtures for testing rxf plugins.

Installed with rxf, so a plugin's own test suite gets them with no conftest:

    def test_my_model(rxf_tiny_checkpoint, rxf_hf_reference, rxf_model_harness):
        path = rxf_tiny_checkpoint("GemmaForCausalLM", tie_word_embeddings=True)
        ours = rxf_model_harness(path).prefill_logits([[5, 80, 17]])[0]
        assert_logits_close(ours, rxf_hf_reference(path).logits([5, 80, 17]))

    def test_served(rxf_tiny_checkpoint, rxf_runtime):
        rt = rxf_runtime(rxf_tiny_checkpoint("GemmaForCausalLM"), **{"attention.backend": "my_backend"})
        rt.generate("hello", {"max_new_tokens": 8, "temperature": 0})

Every fixture is a factory, cached on its arguments, and named `rxf_*` so it cannot shadow a test
suite's own fixtures. This module imports only pytest at load time: pytest loads it in every run of
every project in the environment, so torch and transformers are imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Small enough for CPU test runs: a few requests of a few hundred tokens.
RUNTIME_DEFAULTS: dict[str, Any] = {
    "runtime.device": "cpu",
    "runtime.cpu_threads": 1,
    "runtime.cpu_compile": "off",  # no background compile competing with a test for the cores
    "model.dtype": "float32",
    "cache.max_total_tokens": 4096,
    "scheduler.max_running_requests": 8,
}


def _key(*args: Any, **kwargs: Any) -> str:
    return repr((args, sorted(kwargs.items())))


@pytest.fixture(scope="session")
def rxf_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`rxf_tiny_checkpoint(arch="LlamaForCausalLM", *, seed=0, **config_overrides) -> Path`: a tiny
    random checkpoint (config, safetensors, tokenizer) of any transformers causal-LM architecture,
    written once per session per arguments (see `rxf.testing.checkpoints.make_tiny_checkpoint`)."""
    from rxf.testing.checkpoints import make_tiny_checkpoint

    made: dict[str, Path] = {}

    def make(arch: str = "LlamaForCausalLM", *, seed: int = 0, **config_overrides: Any) -> Path:
        key = _key(arch, seed, **config_overrides)
        if key not in made:
            path = tmp_path_factory.mktemp(f"rxf-tiny-{arch}")
            made[key] = make_tiny_checkpoint(path, arch, seed=seed, **config_overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def rxf_hf_reference() -> Callable[..., Any]:
    """`rxf_hf_reference(path) -> HFReference`: transformers on the checkpoint, with `.logits(tokens)`
    and `.greedy(tokens, n)` (see `rxf.testing.reference`)."""
    from rxf.testing.reference import HFReference

    refs: dict[str, HFReference] = {}

    def get(path: str | Path) -> HFReference:
        key = str(path)
        if key not in refs:
            refs[key] = HFReference(path)
        return refs[key]

    return get


@pytest.fixture(scope="session")
def rxf_model_harness() -> Callable[..., Any]:
    """`rxf_model_harness(path, attention_backend="torch_native", **config_overrides) -> ModelHarness`:
    the model plugin inside rxf's ModelRunner, with `.prefill_logits(prompts)` and
    `.greedy(prompts, n)` (see `rxf.testing.model_harness`). Uses every installed plugin."""
    from rxf.testing.model_harness import ModelHarness

    harnesses: dict[str, ModelHarness] = {}

    def get(path: str | Path, attention_backend: str = "torch_native", **config_overrides: Any) -> ModelHarness:
        key = _key(str(path), attention_backend, **config_overrides)
        if key not in harnesses:
            harnesses[key] = ModelHarness(path, attention_backend, **config_overrides)
        return harnesses[key]

    return get


@pytest.fixture(scope="module")
def rxf_runtime() -> Iterator[Callable[..., Any]]:
    """`rxf_runtime(model_path, **config_overrides) -> Runtime`: the whole engine (scheduler and
    detokenizer processes) on a checkpoint, CPU and float32 unless overridden; or
    `rxf_runtime(config="engine.toml", **config_overrides)` for a config file (or dict) as users
    write it, without those defaults. Shared by the module's tests with the same arguments and shut
    down after the module."""
    from rxf import Runtime

    runtimes: dict[str, Any] = {}

    def get(model_path: str | Path | None = None, *, config: Any = None, **config_overrides: Any) -> Any:
        if (model_path is None) == (config is None):
            raise TypeError("rxf_runtime takes either a model path or config=")
        if config is None:
            config_overrides = {**RUNTIME_DEFAULTS, "model.path": str(model_path), **config_overrides}
        key = _key(str(model_path), str(config), **config_overrides)
        if key not in runtimes:
            runtimes[key] = Runtime.from_config(config, **config_overrides)
        return runtimes[key]

    yield get
    for runtime in runtimes.values():
        runtime.shutdown()
