"""The cpu attention backend against torch_native (one layer, scattered pool slots, stale
req_to_token entries) and against transformers (tiny checkpoints through ModelRunner and Runtime).

Covers: extend over cached prefixes, mixed batches (requests of very different lengths, so extend
packs several padded groups), decode, GQA, sliding windows, soft-caps and sinks, fp32 and bf16, an
FP8 pool with scales, and
greedy tokens through the scheduler with chunked prefill and the radix cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rxf.plugins.attention.cpu import COMPILE_ENV, CpuBackend, pack_groups
from rxf.testing import make_tiny_checkpoint
from rxf.testing.attention import assert_bf16_close, compare_backends, make_case
from rxf.testing.model_parity import check_logits, check_runtime_greedy

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 8},
    "cap": {"logit_cap": 0.9},
    "sinks": {"sinks": SINKS},
    "all": {"sliding_window": 5, "logit_cap": 0.8, "sinks": SINKS},
}
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "device": "cpu"}  # GQA 2
BATCHES = {
    # request 0: a cached prefix past the window; 1: new tokens across the window edge; 2: no prefix
    "extend over prefixes": ([40, 3, 0], [5, 20, 11]),
    "mixed lengths": ([0, 0, 0, 12], [1, 60, 7, 2]),  # several padded groups, one single-token extend
    # a MIXED forward: decode rows (one new token over a prefix, the decode op's) beside a prompt chunk
    "decode rows and a chunk": ([30, 0, 17, 9], [1, 9, 1, 4]),
    "decode": ([1, 7, 30, 45], [1, 1, 1, 1]),
    "decode batch 1": ([9], [1]),
}


@pytest.fixture(autouse=True)
def compile_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend built here (Runtime's scheduler too) waits for its decode op, so decode runs
    the op, not the torch_native fallback it uses meanwhile."""
    monkeypatch.setenv(COMPILE_ENV, "startup")


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("features", list(FEATURES))
def test_matches_torch_native_fp32(features: str, batch: str) -> None:
    out, ref, k, ref_k = compare_backends(CpuBackend, *BATCHES[batch], **SHAPE, dtype=torch.float32, **FEATURES[features])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k, ref_k), "the pools must hold the same K after the forward"


@pytest.mark.parametrize("batch", ["extend over prefixes", "decode rows and a chunk", "decode"])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_matches_torch_native_bf16(features: str, batch: str) -> None:
    out, ref, k, ref_k = compare_backends(CpuBackend, *BATCHES[batch], **SHAPE, dtype=torch.bfloat16, **FEATURES[features])
    assert_bf16_close(out, ref)
    assert torch.equal(k, ref_k)


@pytest.mark.parametrize("batch", ["extend over prefixes", "decode rows and a chunk", "decode"])
def test_fp8_pool_matches_torch_native(batch: str) -> None:
    """An FP8 pool with non-unit scales: both backends quantize on store and dequantize on read."""
    out, ref, k, ref_k = compare_backends(
        CpuBackend, *BATCHES[batch], **SHAPE, dtype=torch.float32, kv_dtype=torch.float8_e4m3fn,
        kv_scales=(0.5, 2.0), **FEATURES["all"],
    )
    # torch_native rounds the dequantized K/V to q's dtype (fp32 here) as the kernel does not: ~1e-6
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))


def test_background_compile_takes_over_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "background")
    ctx = make_case([4], [1], **SHAPE, dtype=torch.float32)[0]
    backend = CpuBackend(ctx)
    assert backend.compiled.wait(120), "the background compile did not finish"
    assert backend._decode is not None
    monkeypatch.setenv(COMPILE_ENV, "soon")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        CpuBackend(ctx)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_decode_op_at_the_head_dims_it_unrolls(head_dim: int, features: str) -> None:
    """The op's compile-time head dims (64, 128; the tests above run its generic loop at 16), with
    the demo's GQA (9 heads over 3), keys past one block, and a single request whose keys are split
    into chunks merged at the end."""
    shape = {"heads": 9, "kv_heads": 3, "head_dim": head_dim, "device": "cpu"}
    extra = {**FEATURES[features], "sinks": torch.linspace(-1.0, 2.0, 9)} if features == "all" else {}
    for prefixes in ([600], [1, 70, 33, 250]):
        out, ref, _, _ = compare_backends(CpuBackend, prefixes, [1] * len(prefixes), **shape, dtype=torch.float32,
                                          **extra)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_pack_groups_bounds_padding() -> None:
    # A long prompt does not pad the short ones up to its length; equal lengths share one group.
    assert pack_groups([100, 5, 5, 5], [100, 5, 5, 5]) == [[0], [1, 2, 3]]
    assert pack_groups([5, 4, 4], [5, 4, 4]) == [[0, 1], [2]]  # a third would pad 75 for 57
    assert pack_groups([8, 8, 8], [8, 8, 8]) == [[0, 1, 2]]
    groups = pack_groups([1, 60, 7, 2], [1, 60, 7, 14])
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # GQA (4 heads over 2), head_dim 16, and a window on no layer: the plain paths.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", seed=5)


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mistral"), "MistralForCausalLM", seed=3, sliding_window=16)


def prompts(vocab: int = 512) -> list[list[int]]:
    return [[(5 + 7 * i + 3 * n) % vocab for i in range(n)] for n in (40, 9, 77)]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_mistral"])
def test_logits_match_transformers(model: str, request: pytest.FixtureRequest) -> None:
    check_logits(request.getfixturevalue(model), prompts(), attention_backend="cpu")


def test_runtime_greedy_matches_transformers(tiny_mistral: Path) -> None:
    check_runtime_greedy(tiny_mistral, prompts(), chunk=8, new_tokens=16, attention={"backend": "cpu"})
