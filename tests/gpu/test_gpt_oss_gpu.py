"""gpt-oss on a GPU (skipped without CUDA).

- The fused MoE kernels with gpt-oss's per-expert biases and clamped SwiGLU, at gpt-oss-20b layer
  shapes (hidden 2880, intermediate 2880, 32 experts, top 4), against the torch path run in float32
  on the same bf16 weights, scored as tests/gpu/test_moe_gpu.py scores Mixtral's.
- MXFP4 dequantized on the GPU equals the CPU result bit for bit.
- A tiny random gpt-oss (sinks, a window of 16 on alternating layers, yarn, biases, 8 experts /
  top 4) through the engine with CUDA graphs generates greedy tokens that transformers in float32
  agrees with (float32: every gap rounding-small; bf16: within 1.5x transformers' own bf16 gap),
  as tests/gpu/test_cuda_graph_gpu.py scores Llama.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from test_cuda_graph_gpu import (  # noqa: E402
    _assert_as_faithful_as_transformers,
    _available_backends,
    _config,
    _prompts,
    _registry,
    _scheduler_greedy,
)

from rxf.core.runner.model_runner import ModelRunner  # noqa: E402
from rxf.plugins.models.gpt_oss import GptOssForCausalLM  # noqa: E402
from rxf.plugins.models.layers.fused_moe import fused_experts  # noqa: E402
from rxf.plugins.models.layers.moe import GatedActivation, experts_native, select_experts  # noqa: E402
from rxf.plugins.models.layers.mxfp4 import dequantize_mxfp4  # noqa: E402
from rxf.testing import make_tiny_checkpoint  # noqa: E402

DEV = torch.device("cuda")
HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4  # one gpt-oss-20b MoE layer
GPT_OSS = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("tokens", [1, 4, 64, 512, 2048])
def test_fused_biased_clamped_experts_at_gpt_oss_20b_shapes(tokens: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(tokens)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, device=DEV, generator=gen) * scale).bfloat16()

    # gate_up pre-activations of a few units, so part of them pass the clamp at 7.
    w13, w2 = randn(EXPERTS, 2 * INTER, HIDDEN, scale=3 * HIDDEN**-0.5), randn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5)
    b13, b2 = randn(EXPERTS, 2 * INTER, scale=1.0), randn(EXPERTS, HIDDEN, scale=0.5)
    x = randn(tokens, HIDDEN, scale=1.0)
    logits = torch.randn(tokens, EXPERTS, device=DEV, generator=gen) + torch.linspace(0, 3, EXPERTS, device=DEV)
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    kw = {"b13": b13, "b2": b2, "activation": GPT_OSS}
    ref = experts_native(x.float(), w13.float(), w2.float(), weights, ids,
                         b13=b13.float(), b2=b2.float(), activation=GPT_OSS)
    fused = fused_experts(x, w13, w2, weights, ids, **kw)
    torch_half = experts_native(x, w13, w2, weights, ids, **kw)
    assert fused.dtype == torch.bfloat16 and fused.shape == (tokens, HIDDEN)
    err, baseline = rel_err(fused, ref), rel_err(torch_half, ref)
    assert err < 1e-2 and err <= 1.5 * baseline + 1e-3, f"fused {err:.2e}, torch path in bf16 {baseline:.2e}"


def test_mxfp4_dequantizes_on_the_gpu_as_on_the_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 64, 90, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (4, 64, 90), generator=gen, dtype=torch.uint8)
    cpu = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    gpu = dequantize_mxfp4(blocks.to(DEV), scales.to(DEV), torch.bfloat16)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=0)


TINY_GPT_OSS = {
    "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 4,
    "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
}
CASES = [(b, d) for b in ("triton", "flashinfer") if b in _available_backends()
         for d in (torch.float32, torch.bfloat16) if not (b == "flashinfer" and d == torch.float32)]


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu-gpt-oss"), "GptOssForCausalLM", seed=3, **TINY_GPT_OSS)


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
def test_gpt_oss_greedy_matches_transformers(tiny_gpt_oss: Path, backend: str, dtype: torch.dtype) -> None:
    config = _config(tiny_gpt_oss, backend, dtype, graphs=True)
    runner = ModelRunner(config, _registry(), str(tiny_gpt_oss))
    assert isinstance(runner.model, GptOssForCausalLM) and runner.cuda_graphs is not None
    # Prompts of 4-40 tokens plus 32 new ones: most requests cross the window of 16 while decoding.
    prompts = _prompts(5, seed=13)
    tokens = _scheduler_greedy(config, runner, tiny_gpt_oss, prompts, 32)
    _assert_as_faithful_as_transformers(tiny_gpt_oss, prompts, tokens, dtype)
