"""The fused decode kernels on the GPU, in bf16 at the Llama-3-8B shapes, against the torch paths:

- rotary embedding fused into the K/V store (triton and flashinfer backends) vs torch_native after
  RotaryEmbedding's torch rotation, through RadixAttention, for extend and decode;
- the Triton GEMV (`layers/gemv_kernel.py`) vs F.linear for every projection role (SiLU·mul for
  gate_up, float32 logits for lm_head), batch 1-8, with and without a K split, and replayed from a
  CUDA graph;
- a whole model with every role on the GEMV (`RXF_GEMV`) vs the same checkpoint on cuBLAS, eager and
  graph-replayed decode.
Skipped without CUDA; the kernel modules are imported only after that check (tests/unit runs them
under the interpreter).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from rxf.core.config import load_config  # noqa: E402
from rxf.core.forward import ForwardMode  # noqa: E402
from rxf.core.registry import PluginRegistry  # noqa: E402
from rxf.core.runner.model_runner import ModelInput, ModelRunner  # noqa: E402
from rxf.plugins.attention.torch_native import TorchNativeBackend  # noqa: E402
from rxf.plugins.models.layers import RadixAttention, RotaryEmbedding  # noqa: E402
from rxf.plugins.models.layers import gemv as gemv_mod  # noqa: E402
from rxf.plugins.models.layers.gemv import GemvSettings  # noqa: E402
from rxf.testing import make_tiny_checkpoint  # noqa: E402
from rxf.testing.attention import make_case  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Qwen2.5's 128k recipe: the fused table carries yarn's attention factor (1.14) on cos and sin.
QWEN25_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}
# Llama-3-8B: name -> (N, K) of the weight; gate_up is [gate | up] (gated), lm_head writes float32.
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------- rope fused into the K/V store
def _backends() -> list[str]:
    registry = PluginRegistry.load()
    return [n for n in ("triton", "flashinfer") if registry.attention_backend(n).is_available(DEV)]


ROPE_CASES = {"extend": ([0, 100, 1500, 7], [37, 64, 300, 1]), "decode": ([1, 60, 700, 4095, 33], [1] * 5)}


@pytest.mark.parametrize("rope_params", [LLAMA31_ROPE, QWEN25_YARN], ids=["llama3", "yarn"])
@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("backend", _backends())
def test_rotary_fused_into_store_matches_torch_native(backend: str, case: str, rope_params: dict) -> None:
    prefix, extend = ROPE_CASES[case]
    ctx, batch, layer, qkv = make_case(prefix, extend, heads=32, kv_heads=8, head_dim=128, dtype=BF16, device="cuda")
    positions = torch.cat([p + torch.arange(e) for p, e in zip(prefix, extend, strict=True)]).to(DEV)
    with torch.device(DEV):
        rope = RotaryEmbedding(128, 8192, rope_params, BF16)
    attn = RadixAttention(layer.layer_id, 32, 8, 128, layer.scaling)
    results = []
    for cls in (TorchNativeBackend, PluginRegistry.load().attention_backend(backend)):
        req_pool, kv_pool = copy.deepcopy((ctx.req_to_token_pool, ctx.token_to_kv_pool))
        b_ctx = replace(ctx, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
        impl = cls(b_ctx)
        b = replace(batch, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, attn_backend=impl,
                    positions=positions)
        impl.init_forward_metadata(b)
        q, k, v = (t.flatten(-2).clone() for t in qkv)
        results.append((attn(q, k, v, b, rotary=rope), kv_pool, impl.fuses_rope(rope)))
    (ref, ref_pool, ref_fused), (out, pool, fused) = results
    assert fused and not ref_fused
    assert _rel_err(out, ref) < 1e-2
    slots = batch.out_cache_loc
    for ours, theirs in ((pool.k_buffer[layer.layer_id], ref_pool.k_buffer[layer.layer_id]),
                         (pool.v_buffer[layer.layer_id], ref_pool.v_buffer[layer.layer_id])):
        assert _rel_err(ours[slots], theirs[slots]) < 1e-2  # rotated in float32 vs bf16: rounding apart
    others = torch.ones(pool.k_buffer[layer.layer_id].shape[0], dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.equal(pool.k_buffer[layer.layer_id][others], ref_pool.k_buffer[layer.layer_id][others])


# ---------------------------------------------------------------- the GEMV
def _gemv_case(role: str, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weight, float32 reference of the role's output)."""
    n, k = SHAPES[role]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=gen).to(BF16)
    w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(BF16)
    ref = F.linear(x.float(), w.float())
    if role == "gate_up_proj":
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    return x, w, ref


@pytest.mark.parametrize("label", ["triton", "n32k256s1st4w4", "n64k128s4st4w4"])
@pytest.mark.parametrize("role", SHAPES)
def test_gemv_matches_linear_at_8b_shapes(role: str, label: str) -> None:
    settings = GemvSettings() if label == "triton" else GemvSettings.parse(label)
    gated, out_dtype = role == "gate_up_proj", torch.float32 if role == "lm_head" else None
    for m in (1, 2, 4, 8):
        x, w, ref = _gemv_case(role, m, seed=m)
        op = gemv_mod.DecodeGemv(settings, w, gated=gated, out_dtype=out_dtype)
        out = op(x, w, None)
        assert out.dtype == (out_dtype or BF16) and out.shape == ref.shape
        assert _rel_err(out, ref) < 1e-2, f"m={m}"
        assert not op.counters.any()


def test_gemv_replays_from_a_cuda_graph() -> None:
    """Split over K (the counters' hand-off) inside a captured graph: replays with new inputs give
    the eager result, and leave the counters zeroed."""
    x, w, _ = _gemv_case("o_proj", 4)
    op = gemv_mod.DecodeGemv(GemvSettings.parse("n32k256s4st4w4"), w)
    static_x = x.clone()
    op(static_x, w, None)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(static_x, w, None)
    for seed in range(3):
        static_x.copy_(torch.randn(x.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(static_out, op(static_x, w, None), rtol=0, atol=0)
        assert not op.counters.any()


# ---------------------------------------------------------------- a model on the GEMV
TINY = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 1024, "num_hidden_layers": 2, "vocab_size": 1000}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemv-llama"), seed=5, **TINY)


def _runner(ckpt: Path, monkeypatch: pytest.MonkeyPatch, gemv_env: str) -> ModelRunner:
    monkeypatch.setenv(gemv_mod.ENV, gemv_env)
    gemv_mod._from_env.cache_clear()
    try:
        config = load_config({
            "model": {"path": str(ckpt), "dtype": "bfloat16"}, "runtime": {"device": "cuda"},
            "attention": {"backend": "triton"}, "scheduler": {"max_running_requests": 16},
            "cache": {"max_total_tokens": 4096}, "cuda_graph": {"enabled": True, "batch_sizes": [1, 2, 4, 8]},
        })
        return ModelRunner(config, PluginRegistry.load(), str(ckpt))
    finally:
        gemv_mod._from_env.cache_clear()


def test_model_on_gemv_matches_cublas(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    all_roles = ",".join(f"{role}=triton" for role in gemv_mod.ROLES)
    ours, theirs = _runner(ckpt, monkeypatch, all_roles), _runner(ckpt, monkeypatch, "")
    layer = ours.model.model.layers[0]
    assert layer.self_attn.qkv_proj.gemv is not None and layer.mlp.gate_up_act is not None
    assert theirs.model.model.layers[0].self_attn.qkv_proj.gemv is None
    for bs in (1, 3, 8):
        logits = []
        for runner in (ours, theirs):
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool.clear()
            prompts = [[(7 * i + j) % 900 + 5 for j in range(3 + 5 * i)] for i in range(bs)]
            rows = [runner.req_to_token_pool.alloc() for _ in prompts]
            slots = runner.token_to_kv_pool.alloc(sum(map(len, prompts)))
            flat = [t for p in prompts for t in p]
            runner.forward(ModelInput(ForwardMode.PREFILL, rows, flat, [0] * bs, [len(p) for p in prompts], slots))
            decode = ModelInput(ForwardMode.DECODE, rows, [11] * bs, [len(p) for p in prompts], [1] * bs,
                                runner.token_to_kv_pool.alloc(bs))
            replayed = runner.forward(decode).clone()
            graphs, runner.cuda_graphs = runner.cuda_graphs, None
            eager = runner.forward(decode).clone()  # the same step again, eagerly
            runner.cuda_graphs = graphs
            torch.testing.assert_close(replayed, eager, rtol=0, atol=2e-2 * eager.abs().max().item())
            logits.append(eager)
        assert _rel_err(logits[0], logits[1]) < 2e-2, f"bs={bs}"
