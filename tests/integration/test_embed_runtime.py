"""`model.task = "embed"` through the whole engine (`Runtime.embed`): a tiny Qwen3 with mean pooling
(its sentence-transformers config) against transformers' pooled hidden states, prompts chunked at
8 tokens so that a vector is summed over several steps of a batch; truncation, normalisation, the
KV released at once, and generation refused."""

from __future__ import annotations

import pytest
import torch

from rxf.testing.checkpoints import add_sentence_transformers_config, make_tiny_checkpoint
from rxf.testing.model_parity import runtime_config
from rxf.testing.reference import HFReference

PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((57, 40, 18))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3-embed-mean"), "Qwen3ForCausalLM", seed=3, head_dim=32)
    return add_sentence_transformers_config(path, "mean_tokens", normalize=False), HFReference(path)


@pytest.fixture(scope="module")
def runtime(checkpoint):
    from rxf import Runtime

    # Overlap on: a prompt's last chunk may be planned before its previous one is postprocessed.
    config = runtime_config(
        checkpoint[0], chunk=8, model={"task": "embed"}, scheduler={"max_prefill_tokens": 64, "overlap": True}
    )
    with Runtime.from_config(config) as rt:
        yield rt


def _close(ours: list[float], ref: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(ours), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_mean_pooling_matches_transformers(runtime, checkpoint) -> None:
    _, ref = checkpoint
    outs = runtime.embed(input_ids=PROMPTS)
    for ids, out in zip(PROMPTS, outs, strict=True):
        _close(out["embedding"], ref.embedding(ids, "mean", normalize=False))
        assert out["meta_info"]["prompt_tokens"] == len(ids)
    text = "The quick brown fox jumps over the lazy dog."
    ids = runtime.tokenizer.encode(text)
    _close(runtime.embed(text)["embedding"], ref.embedding(ids, "mean", normalize=False))


def test_dimensions_truncate_then_normalise(runtime, checkpoint) -> None:
    _, ref = checkpoint
    out = runtime.embed(input_ids=PROMPTS[0], dimensions=16, normalize=True)["embedding"]
    assert len(out) == 16
    _close(out, ref.embedding(PROMPTS[0], "mean", normalize=True, dimensions=16))


def test_kv_released_and_nothing_cached(runtime) -> None:
    """Mean pooling runs without the prefix cache (a cached prefix's states are not computed)."""
    runtime.embed(input_ids=PROMPTS)
    stats = runtime.get_stats()
    assert (stats.free_slots, stats.tree_slots, stats.num_running) == (stats.total_slots, 0, 0)


def test_refuses_generation_and_bad_fields(runtime) -> None:
    with pytest.raises(ValueError, match="serves embeddings"):
        runtime.generate("Hello", {"max_new_tokens": 4})
    with pytest.raises(ValueError, match=r"dimensions: must be in \[1, 64\]"):
        runtime.embed("Hello", dimensions=65)
    with pytest.raises(ValueError, match="input_ids: the prompt is empty"):
        runtime.embed(input_ids=[])
