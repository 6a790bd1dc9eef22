"""The fused decode kernels on the GPU, in bf16 at the Llama-3-8B shapes, against the torch paths:

- rotary embedding fused into the K/V store (triton and flashinfer backends) vs torch_native after
  RotaryEmbedding's torch rotation, through RadixAttention, for extend and decode;
- the Triton GEMV (`layers/gemv_kernel.py`) vs F.linear for every projection role (SiLU·mul for
  gate_up, float32 logits for lm_head), batch 1-8, with and without a K split, and replayed from a
  CUDA graph;
- a whole model with every role on the GEMV (`RXF_GEMV`) vs the same checkpoint on cuBLAS, eager and
  graph-replayed decode;
- programmatic dependent launch: chains of decode kernels (norm and GEMV; norm, quantized GEMV and
  head norm; norm, router GEMV, routing and the MoE decode kernels) captured with PDL in a CUDA graph
  and replayed give the bits of the same kernels run without PDL.
Skipped without CUDA; the kernel modules are imported only after that check (tests/unit runs them
under the interpreter).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

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
from rxf.plugins.quantization import fp8_ops, qgemv  # noqa: E402
from rxf.plugins.quantization.int4 import pack_int32  # noqa: E402
from rxf.plugins.quantization.qgemv import QuantGemv  # noqa: E402
from rxf.testing import make_tiny_checkpoint  # noqa: E402
from rxf.testing.attention import make_case  # noqa: E402
from rxf.testing.pdl import pdl_env  # noqa: E402

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


@pytest.mark.parametrize("shape", list(gemv_mod.SHAPE_DEFAULTS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_shape_defaults_match_linear_at_their_shapes(shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `SHAPE_DEFAULTS` label, as `decode_gemv` picks it on a Hopper GPU with `RXF_GEMV` unset, at
    its own weight shape (lm_head's with float32 output), 1-8 rows, against the float32 product."""
    monkeypatch.delenv(gemv_mod.ENV, raising=False)
    gemv_mod._from_env.cache_clear()
    n, k = shape
    gen = torch.Generator(device=DEV).manual_seed(n)
    w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(BF16)
    try:
        op = gemv_mod.decode_gemv("lm_head", w, out_dtype=torch.float32)
    finally:
        gemv_mod._from_env.cache_clear()
    if torch.cuda.get_device_capability()[0] != 9:
        assert op is None  # cuBLAS off Hopper
        return
    assert op.settings.label == gemv_mod.SHAPE_DEFAULTS[shape]  # (each label names its split)
    for m in (1, 2, 8):
        x = torch.randn(m, k, device=DEV, generator=gen).to(BF16)
        out = op(x, w, None)
        assert out.dtype == torch.float32 and _rel_err(out, F.linear(x.float(), w.float())) < 1e-2, f"m={m}"
        assert not op.counters.any()


@pytest.mark.parametrize("label", ["triton", "n32k256s1st4w4", "n64k128s4st4w4", "rn16k512s2st2w8", "rn32k256s1st2w8"])
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


# ---------------------------------------------------------------- norm kernel, PDL chains
HOPPER = torch.cuda.get_device_capability()[0] >= 9
needs_pdl = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs compute capability 9.0")


@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=needs_pdl)], ids=["plain", "pdl"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_decode_rmsnorm_matches_flashinfer_numerics(rows: int, gemma: bool, pdl: bool) -> None:
    """Against the torch reference of its numerics and against FlashInfer's kernel itself (the norm
    prefill runs): equal up to a rounding step on a few elements (the sums' order differs)."""
    from rxf.plugins.models.layers.norm import GemmaRMSNorm, RMSNorm
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm
    from rxf.testing.norm_reference import rmsnorm_reference

    gen = torch.Generator(device=DEV).manual_seed(rows)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(4096, eps=1e-5, dtype=BF16).to(DEV)
    norm.weight.data = (torch.randn(4096, device=DEV, generator=gen) * 0.3 + (0.0 if gemma else 1.0)).to(BF16)
    x = (torch.randn(rows, 4096, device=DEV, generator=gen) * 4).to(BF16)
    res = torch.randn(rows, 4096, device=DEV, generator=gen).to(BF16)
    want, want_sum = rmsnorm_reference(x, norm.weight, norm.eps, res, gemma=gemma)
    res_out = res.clone()
    with pdl_env(pdl):
        out = rmsnorm(x, norm.weight, norm.eps, res_out, gemma=gemma)
    assert torch.equal(res_out, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
    assert (out != want).float().mean().item() < 0.01, "at most a rounding step on a few elements"
    alone = rmsnorm(x, norm.weight, norm.eps, gemma=gemma)
    torch.testing.assert_close(alone, rmsnorm_reference(x, norm.weight, norm.eps, gemma=gemma)[0])
    fi = pytest.importorskip("flashinfer")
    fi_x, fi_res = x.clone(), res.clone()
    (fi.norm.gemma_fused_add_rmsnorm if gemma else fi.norm.fused_add_rmsnorm)(fi_x, fi_res, norm.weight, norm.eps)
    assert torch.equal(fi_res, want_sum)
    assert (out != fi_x).float().mean().item() < 0.01, "FlashInfer's norm, up to a rounding step on a few elements"


def _pdl_graph_equals_eager(chain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], shape: tuple[int, int]) -> None:
    """PDL changes when kernels start, never what they compute: `chain(x, res)` (every kernel reading the
    previous one's output; the residual updated in place) captured in a graph with PDL and replayed
    with 4 new inputs gives the bits of the same kernels run eagerly without PDL (a kernel reading
    its input before the previous one finished would not)."""
    from rxf.core.runner.pdl import use_pdl

    expected = []
    with pdl_env(False):
        for seed in range(4):
            g = torch.Generator(device=DEV).manual_seed(100 + seed)
            x, res = (torch.randn(shape, device=DEV, generator=g).to(BF16) for _ in range(2))
            assert not use_pdl(x)
            expected.append((x, res, chain(x.clone(), res.clone())))
    with pdl_env(True):
        static_x, static_res = torch.zeros(shape, device=DEV, dtype=BF16), torch.zeros(shape, device=DEV, dtype=BF16)
        assert use_pdl(static_x)
        chain(static_x.clone(), static_res.clone())  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = chain(static_x, static_res)
        for x, res, want in expected:
            static_x.copy_(x)
            static_res.copy_(res)
            graph.replay()
            assert torch.equal(static_out, want)


@needs_pdl
@pytest.mark.parametrize(("label", "rows"), [("n64k256s2st4w4", 2), ("rn16k512s2st2w8", 1)])
def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl(label: str, rows: int) -> None:
    """8 norm + GEMV pairs (split over K, 4096 x 4096) over the residual stream; the tile kernel at 2
    rows, the row kernel at 1."""
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm

    gen = torch.Generator(device=DEV).manual_seed(11)
    weights = [(torch.randn(4096, 4096, device=DEV, generator=gen) / 64).to(BF16) for _ in range(8)]
    ops = [gemv_mod.DecodeGemv(GemvSettings.parse(label), w) for w in weights]
    norm_w = (torch.rand(4096, device=DEV, generator=gen) + 0.5).to(BF16)

    def chain(h: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        for w, op in zip(weights, ops, strict=True):
            h = op(rmsnorm(h, norm_w, 1e-5, res), w, None)
        return h

    _pdl_graph_equals_eager(chain, (rows, 4096))
    assert all(not op.counters.any() for op in ops)


def _quant_gemv(fmt: str, gen: torch.Generator) -> QuantGemv:
    """A 4096 x 4096 layer's quantized GEMV as the method builds it at load (default tile sizes, split
    over K by the SM count): FP8 with row scales, FP8 with 128 x 128 block scales, int4 in groups of 128."""
    n = k = 4096
    if fmt == "int4":
        codes = torch.randint(0, 16, (k, n), device=DEV, dtype=torch.uint8, generator=gen)
        zeros = torch.randint(0, 16, (k // 128, n), device=DEV, generator=gen).to(BF16)
        scales = (torch.rand(k // 128, n, device=DEV, generator=gen) * 2e-3 + 1e-4).to(BF16)
        op = qgemv.int4(SimpleNamespace(qweight=pack_int32(codes, 0), scales=scales, zeros=zeros, gemv_role="o_proj"),
                        128)
    else:
        q, rows = fp8_ops.quantize_rows(torch.randn(n, k, device=DEV, generator=gen) / 64)
        if fmt == "fp8":
            op = qgemv.fp8_rows(SimpleNamespace(weight=q, weight_scale=rows, gemv_role="o_proj"))
        else:
            blocks = (torch.rand(n // 128, k // 128, device=DEV, generator=gen) + 0.5) * rows.mean()
            layer = SimpleNamespace(weight=q, weight_scale_inv=blocks.repeat_interleave(128, dim=0), gemv_role="o_proj")
            op = qgemv.fp8_blocks(layer, 128, 128)
    assert op is not None and op.settings.split_k > 1, "the chain should cover the split-K hand-off"
    return op


@needs_pdl
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int4"])
def test_pdl_chain_through_quantized_gemv_and_head_norm(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """6 x (norm -> quantized GEMV -> Qwen3 head norm in place), the GEMV's output read as 24 query and
    8 key heads of 128: the GEMV reads its first weight tile and the head norm its weights before
    waiting."""
    from rxf.plugins.models.layers.head_norm_kernel import norm_heads_cuda_
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm

    monkeypatch.setenv(qgemv.ENV, "fp8=auto,fp8-block=auto,int4=auto")  # off unless asked for
    qgemv._plan.cache_clear()
    gen = torch.Generator(device=DEV).manual_seed(12)
    ops = [_quant_gemv(fmt, gen) for _ in range(6)]
    norm_w = (torch.rand(4096, device=DEV, generator=gen) + 0.5).to(BF16)
    q_w, k_w = ((torch.rand(128, device=DEV, generator=gen) + 0.5).to(BF16) for _ in range(2))

    def chain(h: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        for op in ops:
            h = op(rmsnorm(h, norm_w, 1e-5, res), None)
            norm_heads_cuda_(h, q_w, k_w, 24, 8, 128, 1e-6)
        return h

    _pdl_graph_equals_eager(chain, (3, 4096))
    assert all(not op.counters.any() for op in ops)


ROW_MOE_BLOCKS = ((16, 256, 4, 1, True), (16, 512, 8, 1, True))
TILE_MOE_BLOCKS = ((16, 256, 4, 4, False), (32, 256, 4, 4, False))  # the tile form (tl.dot)


@needs_pdl
@pytest.mark.parametrize(("form", "tokens"), [("tile", 3), ("row", 1), ("row", 3)])
def test_pdl_chain_through_the_moe_decode_path(form: str, tokens: int) -> None:
    """4 MoE layers at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of 768, top 8), 1-3 tokens:
    residual add + norm + router projection + routing in one launch (`norm_route_cuda`) -> gate/up
    and down decode kernels, the expert kernels waiting for the x and ids it writes; its and the down
    kernel's hand-offs leave their counters zeroed."""
    from rxf.plugins.models.layers import fused_moe_decode
    from rxf.plugins.models.layers.routing_kernel import norm_route_cuda

    hidden, experts, inter, top_k = 2048, 128, 768, 8
    gen = torch.Generator(device=DEV).manual_seed(13)
    layers = []
    for _ in range(4):
        router = (torch.randn(experts, hidden, device=DEV, generator=gen) / hidden**0.5).to(BF16)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV, generator=gen) / hidden**0.5).to(BF16)
        w2 = (torch.randn(experts, hidden, inter, device=DEV, generator=gen) / inter**0.5).to(BF16)
        layers.append((router, w13, w2))
    norm_w = (torch.rand(hidden, device=DEV, generator=gen) + 0.5).to(BF16)

    def chain(h: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        for router, w13, w2 in layers:
            weights, ids, x, res = norm_route_cuda(h, res, norm_w, 1e-5, router, None, top_k, renormalize=True)
            h = fused_moe_decode.decode_experts(x, w13, w2, weights, ids, blocks=blocks)
        return h

    blocks = ROW_MOE_BLOCKS if form == "row" else TILE_MOE_BLOCKS
    _pdl_graph_equals_eager(chain, (tokens, hidden))
    if form == "row":  # and the ROW form computes what the tile form does
        x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(BF16)
        weights, ids = torch.full((tokens, top_k), 1 / top_k, device=DEV), torch.stack(
            [torch.randperm(experts, device=DEV, generator=gen)[:top_k] for _ in range(tokens)])
        _, w13, w2 = layers[0]
        got = fused_moe_decode.decode_experts(x, w13, w2, weights, ids, blocks=ROW_MOE_BLOCKS)
        want = fused_moe_decode.decode_experts(x, w13, w2, weights, ids, blocks=TILE_MOE_BLOCKS)
        assert _rel_err(got, want) < 1e-2
    assert not fused_moe_decode.launch_counters(norm_w.device, 1).any()  # keyed by the tensors' device (cuda:N)


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


@pytest.mark.parametrize("setting", ["triton", "rn16k256s2st2w4"], ids=["tile", "row"])
@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=needs_pdl)], ids=["plain", "pdl"])
def test_model_on_gemv_matches_cublas(ckpt: Path, monkeypatch: pytest.MonkeyPatch, pdl: bool, setting: str) -> None:
    """Every role on the GEMV (the row kernel at batch 1 for `row`) against cuBLAS; with PDL the GEMVs,
    norms, K/V store, attention and argmax of the step all launch early (a race would show as graph !=
    eager or a logits error)."""
    with pdl_env(pdl):
        _model_on_gemv_matches_cublas(ckpt, monkeypatch, setting)


def _model_on_gemv_matches_cublas(ckpt: Path, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    all_roles = ",".join(f"{role}={setting}" for role in gemv_mod.ROLES)
    ours, theirs = _runner(ckpt, monkeypatch, all_roles), _runner(ckpt, monkeypatch, "cublas")
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
