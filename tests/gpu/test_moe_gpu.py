"""The fused MoE Triton kernels and Mixtral on a GPU (skipped without CUDA).

- At Mixtral-8x7B layer shapes (hidden 4096, intermediate 14336, 8 experts, top 2) for token counts
  from decode to prefill, the fused kernels' output against the torch path (`experts_native`) run in
  float32 on the same bf16/fp16 weights: its relative error must be a half-precision rounding error
  (< 1%) and at most 1.5x (+0.1%) the error of the torch path itself run in that half precision.
- A CUDA-graph replay of the fused path equals its eager run (alignment included: no host sync).
- A tiny random Mixtral through the engine (graphs on, fused path) generates greedy tokens that
  transformers in float32 agrees with, as tests/gpu/test_cuda_graph_gpu.py scores Llama.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from test_cuda_graph_gpu import _assert_as_faithful_as_transformers, _config, _prompts, _registry  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rxf.core.ipc.messages import PreparedRequest  # noqa: E402
from rxf.core.runner.model_runner import ModelRunner  # noqa: E402
from rxf.core.sampling_params import SamplingParams  # noqa: E402
from rxf.core.scheduler.scheduler import Scheduler  # noqa: E402
from rxf.plugins.models.layers.fused_moe import fused_experts  # noqa: E402
from rxf.plugins.models.layers.moe import experts_native, select_experts  # noqa: E402
from rxf.testing import make_tiny_checkpoint  # noqa: E402

DEV = torch.device("cuda")
HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2  # one Mixtral-8x7B layer


@pytest.fixture(scope="module")
def mixtral_layer() -> tuple[torch.Tensor, torch.Tensor]:
    """float32 expert weights (~5.6 GB), scaled so activations stay O(1)."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEV, generator=gen).mul_(HIDDEN**-0.5)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEV, generator=gen).mul_(INTER**-0.5)
    return w13, w2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(
    ("tokens", "dtype"),
    [(t, torch.bfloat16) for t in (1, 16, 64, 256, 1024, 4096)] + [(t, torch.float16) for t in (1, 256)],
)
def test_fused_matches_torch_path_at_mixtral_shapes(mixtral_layer, tokens: int, dtype: torch.dtype) -> None:
    w13_32, w2_32 = mixtral_layer
    w13, w2 = w13_32.to(dtype), w2_32.to(dtype)
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device=DEV, generator=gen).to(dtype)
    # Skewed router logits: some experts get many more tokens than others (uneven padding).
    bias = torch.linspace(0, 3, EXPERTS, device=DEV)
    weights, ids = select_experts(torch.randn(tokens, EXPERTS, device=DEV, generator=gen) + bias, TOP_K, True)
    ref = experts_native(x.float(), w13.float(), w2.float(), weights, ids)
    fused = fused_experts(x, w13, w2, weights, ids)
    torch_half = experts_native(x, w13, w2, weights, ids)
    assert fused.dtype == dtype and fused.shape == (tokens, HIDDEN)
    err, baseline = rel_err(fused, ref), rel_err(torch_half, ref)
    assert err < 1e-2 and err <= 1.5 * baseline + 1e-3, f"fused {err:.2e}, torch path in {dtype} {baseline:.2e}"


def test_graph_replay_equals_eager(mixtral_layer) -> None:
    w13, w2 = (w.to(torch.bfloat16) for w in mixtral_layer)
    tokens = 8
    x = torch.randn(tokens, HIDDEN, device=DEV, dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, EXPERTS, device=DEV), TOP_K, True)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for seed in range(3):  # new inputs and routing written into the captured buffers
        gen = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(x.shape, device=DEV, generator=gen))
        new_weights, new_ids = select_experts(torch.randn(tokens, EXPERTS, device=DEV, generator=gen), TOP_K, True)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, w13, w2, weights, ids), rtol=0, atol=0)


TINY_MIXTRAL = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                "intermediate_size": 1024, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu-mixtral"), "MixtralForCausalLM", seed=3, **TINY_MIXTRAL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mixtral_greedy_matches_transformers(tiny_mixtral: Path, dtype: torch.dtype) -> None:
    config = _config(tiny_mixtral, "triton", dtype, graphs=True)
    runner = ModelRunner(config, _registry(), str(tiny_mixtral))
    assert runner.cuda_graphs is not None
    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(tiny_mixtral), check_memory=True)
    prompts = _prompts(5, seed=12)
    params = SamplingParams.from_dict({"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True})
    for i, p in enumerate(prompts):
        sched.add_request(PreparedRequest(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    while sched.has_work:
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    _assert_as_faithful_as_transformers(tiny_mixtral, prompts, [got[f"r{i}"] for i in range(len(prompts))], dtype)
