"""The weight-only decode GEMV of quantized layers (`quantization/qgemv_kernel.py`) on the GPU, in bf16
(skipped without CUDA; tests/unit/test_quant_gemv.py runs the kernel under the interpreter):

- the kernel as the methods build it at load (`qgemv.fp8_rows`, `fp8_blocks`, `int4`), at the
  Llama-3-8B projection shapes, batch 1-8, for FP8 with row scales, FP8 with 128 x 128 block scales
  and int4 in groups of 128 with zero points, against F.linear in float32 on the weight each
  format's own code dequantizes: < 1% relative error (bf16 output, float32 accumulation); then
  captured in a CUDA graph and replayed with new inputs: the eager bits, the counters left zeroed;
- at batch 1, the row kernel of a gate/up layer with the SiLU·mul in its launch (`QuantGemv.activated`),
  every format, against float32 and against the two launches, and replayed from a CUDA graph;
- tiny quantized checkpoints through `ModelRunner` with CUDA graphs (tile settings, or row labels whose
  gate/up takes its SiLU·mul at batch 1): at decode (batch 1, 3, 8, after
  prefills of at most 8 tokens, which take the GEMV too) every method's layers run the GEMV, the
  graph-replayed step gives the eager step's logits, and both are within 5% of transformers running
  the dequantized float32 twin (weight-only, so bf16 rounding is the only error: the int4 GEMM's
  bound in test_quantization_gpu.py; no activation is quantized here, so FP8 meets it too).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from rxf.core.forward import ForwardMode  # noqa: E402
from rxf.core.runner.model_runner import ModelInput  # noqa: E402
from rxf.plugins.quantization import fp8_ops, qgemv  # noqa: E402
from rxf.plugins.quantization.int4 import Int4Weights, pack_int32  # noqa: E402
from rxf.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from rxf.testing.model_harness import ModelHarness  # noqa: E402
from rxf.testing.quantized_checkpoints import quantize_checkpoint  # noqa: E402
from rxf.testing.reference import HFReference  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
ALL_AUTO = "fp8=auto,fp8-block=auto,int4=auto"
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


@pytest.fixture(autouse=True)
def default_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(qgemv.ENV, ALL_AUTO)  # the GEMV is off unless asked for
    qgemv._plan.cache_clear()
    yield monkeypatch
    qgemv._plan.cache_clear()
    qgemv._gated_formats.cache_clear()  # (a test may set RXF_QGEMV_GATED)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _layer(fmt: str, role: str, gen: torch.Generator) -> tuple[qgemv.QuantGemv, torch.Tensor]:
    """(the GEMV the method would build for a `role` layer of `fmt`, its dense float32 weight)."""
    n, k = SHAPES[role]
    if fmt == "int4":
        codes = torch.randint(0, 16, (k, n), device=DEV, dtype=torch.uint8, generator=gen)
        zeros = torch.randint(0, 16, (k // 128, n), device=DEV, generator=gen).float()
        scales = (torch.rand(k // 128, n, device=DEV, generator=gen) * 2e-3 + 1e-4).to(BF16)
        dense = Int4Weights(codes, zeros, scales, torch.arange(k, device=DEV) // 128).dequantize(torch.float32)
        layer = SimpleNamespace(qweight=pack_int32(codes, 0), scales=scales, zeros=zeros.to(BF16), gemv_role=role)
        return qgemv.int4(layer, 128), dense
    q, rows = fp8_ops.quantize_rows(torch.randn(n, k, device=DEV, generator=gen) / k**0.5)
    if fmt == "fp8":
        op = qgemv.fp8_rows(SimpleNamespace(weight=q, weight_scale=rows, gemv_role=role))
        return op, fp8_ops.dequantize_rows(q, rows, torch.float32)
    blocks = (torch.rand(n // 128, k // 128, device=DEV, generator=gen) + 0.5) * rows.mean()
    scale_inv = blocks.repeat_interleave(128, dim=0)  # one row of block scales per output row, as loaded
    op = qgemv.fp8_blocks(SimpleNamespace(weight=q, weight_scale_inv=scale_inv, gemv_role=role), 128, 128)
    assert op is not None and op.scale_rows == 128, "the kernel reads one scale per 128 x 128 block"
    return op, fp8_ops.dequantize_blocks(q, scale_inv, 128, torch.float32)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)).to(BF16)


def _assert_graph_replays_eager_bits(op: qgemv.QuantGemv, m: int, k: int, bias: torch.Tensor | None) -> None:
    """A CUDA graph of `op` over a static x `[m, k]`, replayed on new inputs, gives the eager launch's
    bits and leaves the split-K counters zeroed."""
    static_x = _x(m, k, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(static_x, bias)
    for seed in range(2):
        static_x.copy_(_x(m, k, 100 + seed))
        graph.replay()
        torch.testing.assert_close(static_out, op(static_x, bias), rtol=0, atol=0)
        assert not op.counters.any()


@pytest.mark.parametrize("role", SHAPES)
@pytest.mark.parametrize("fmt", qgemv.FORMATS)
def test_gemv_matches_the_dequantized_matmul_and_replays(fmt: str, role: str) -> None:
    op, dense = _layer(fmt, role, torch.Generator(device=DEV).manual_seed(1))
    assert op is not None
    k = SHAPES[role][1]
    assert op.max_rows == (16 if fmt == "int4" else 8)  # int4: the tile's 16 rows (`qgemv._MOST_ROWS`)
    for m in (1, 2, 4, 8, 13, 16) if fmt == "int4" else (1, 2, 4, 8):
        x = _x(m, k, m)
        out = op(x, None)
        assert out.dtype == BF16 and out.shape == (m, SHAPES[role][0])
        assert _rel_err(out, F.linear(x.float(), dense)) < 1e-2, f"m={m}"
        assert not op.counters.any()
    _assert_graph_replays_eager_bits(op, 8, k, None)


@pytest.mark.parametrize("label", ["n32k128s4st3w4", "n64k128s0st4w4", "rn32k128s2st1w4", "rn64k128s0st1w8",
                                   "rn128k128s0st1w4", "rn64k128s0st2w4"])
@pytest.mark.parametrize("fmt", qgemv.FORMATS)
def test_gemv_with_a_label_from_the_environment(fmt: str, label: str, default_settings: pytest.MonkeyPatch) -> None:
    """A label as the benchmark prints it (explicit split or split 0; the row kernel, one or two tiles
    read ahead), with a bias. Int4 at one row takes bf16x2 arithmetic (`RXF_INT4_PAIRS`)."""
    default_settings.setenv(qgemv.ENV, f"{ALL_AUTO},{fmt}:down_proj={label}")
    qgemv._plan.cache_clear()
    op, dense = _layer(fmt, "down_proj", torch.Generator(device=DEV).manual_seed(2))
    split = op.settings.split_k  # split 0: resolved from the shape and the SM count
    assert split >= 1 and op.settings.label == label.replace("s0st", f"s{split}st")
    bias = torch.randn(4096, device=DEV).to(BF16)
    for m in (1, 3, 8):
        x = _x(m, 14336, m)
        assert _rel_err(op(x, bias), F.linear(x.float(), dense, bias.float())) < 1e-2, f"m={m}"


@pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="TMA needs sm_90")
@pytest.mark.parametrize("label", ["trn32k128s0st4w4", "trn64k128s6st3w4", "trn16k128s8st6w2"])
@pytest.mark.parametrize("role", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_tma_row_kernel_matches_the_dequantized_matmul_and_replays(fmt: str, role: str, label: str,
                                                                    default_settings: pytest.MonkeyPatch) -> None:
    """Prefix t: batch 1 reads the weight by TMA (`qgemv_tma_kernel`), with a bias and under PDL, and a
    CUDA graph of it replays the same bits; 2 rows take the tile kernel."""
    default_settings.setenv(qgemv.ENV, f"{fmt}={label}")
    qgemv._plan.cache_clear()
    op, dense = _layer(fmt, role, torch.Generator(device=DEV).manual_seed(3))
    assert op is not None and op.tma_desc is not None and op.label.startswith("trn"), op.label
    n, k = SHAPES[role]
    bias = torch.randn(n, device=DEV).to(BF16)
    for m in (1, 2):
        x = _x(m, k, 7 + m)
        assert _rel_err(op(x, bias), F.linear(x.float(), dense, bias.float())) < 1e-2, f"m={m}"
        assert not op.counters.any()
    _assert_graph_replays_eager_bits(op, 1, k, bias)


@pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0), reason="the shape defaults are sm_90's")
@pytest.mark.parametrize("fmt", qgemv.FORMATS)
def test_unnamed_formats_take_the_measured_settings_of_their_shape(fmt: str, default_settings) -> None:
    """Without an `RXF_QGEMV` entry for the format, a layer of a Llama-3-8B shape in
    `qgemv.SHAPE_DEFAULTS` takes that label (resolved as given), other shapes `BY_DEFAULT`'s; an entry
    for the format (here `auto`) takes precedence over both."""
    default_settings.delenv(qgemv.ENV)
    qgemv._plan.cache_clear()
    for role in SHAPES:
        op, _ = _layer(fmt, role, torch.Generator(device=DEV).manual_seed(3))
        n, k = SHAPES[role]
        expected = qgemv.SHAPE_DEFAULTS.get((fmt, n, k))
        if expected is None:
            assert op.settings.row and op.settings.num_warps == qgemv.BY_DEFAULT[fmt][0].tiles.num_warps, role
        else:
            assert op.label == expected, role
    default_settings.setenv(qgemv.ENV, f"{fmt}=auto")
    qgemv._plan.cache_clear()
    op, _ = _layer(fmt, "qkv_proj", torch.Generator(device=DEV).manual_seed(3))
    assert not op.settings.row, "an RXF_QGEMV entry overrides the shape defaults"


@pytest.mark.parametrize("fmt", qgemv.FORMATS)
def test_row_kernel_takes_the_silu_mul_in(fmt: str, default_settings) -> None:
    """At batch 1 with gate/up's row label (the shape's own on sm_90: `SHAPE_DEFAULTS`),
    `QuantGemv.activated`: SiLU·mul after the projection in its launch, against the same in float32 on
    the dequantized weight (< 1% relative error) and against the two launches (the GEMV, SiLU·mul);
    replayed from a CUDA graph: the eager bits, the counters zeroed."""
    from rxf.plugins.models.layers.activation import SiluAndMul

    default_settings.delenv(qgemv.ENV)
    default_settings.setenv(qgemv.GATED_ENV, fmt)
    qgemv._plan.cache_clear()
    qgemv._gated_formats.cache_clear()
    op, dense = _layer(fmt, "gate_up_proj", torch.Generator(device=DEV).manual_seed(2))
    assert op is not None and op.settings.row, op.label
    n, k = SHAPES["gate_up_proj"]
    act = SiluAndMul()
    x = _x(1, k, 5)
    out = op.activated(x, None, act)
    y = F.linear(x.float(), dense)
    assert out.shape == (1, n // 2) and _rel_err(out, F.silu(y[:, : n // 2]) * y[:, n // 2 :]) < 1e-2
    assert _rel_err(out, act(op(x, None))) < 1e-2
    assert not op.counters.any()
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op.activated(static_x, None, act)
    for seed in range(2):
        static_x.copy_(_x(1, k, 200 + seed))
        graph.replay()
        torch.testing.assert_close(static_out, op.activated(static_x, None, act), rtol=0, atol=0)
        assert not op.counters.any()


@pytest.mark.parametrize("label", ["xn64k128s0st4w4", "xn128k256s0st3w8"])
@pytest.mark.parametrize("role", SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_fp8_x_follows_torchs_per_tile_quantization(fmt: str, role: str, label: str,
                                                    default_settings: pytest.MonkeyPatch) -> None:
    """Prefix x: x quantized to E4M3 per row and K tile (block_k 128 for block scales, which cap it)
    and multiplied FP8 x FP8. Against F.linear over x quantized the same way by torch (float32,
    round to nearest even): < 0.5% apart, where the exact product of the plain GEMV is 2-5% away."""
    default_settings.setenv(qgemv.ENV, f"{fmt}={label}")
    qgemv._plan.cache_clear()
    op, dense = _layer(fmt, role, torch.Generator(device=DEV).manual_seed(3))
    assert op is not None and op.fp8_x
    tile = op.settings.block_k
    k = SHAPES[role][1]
    for m in (1, 4):
        x = _x(m, k, m) * torch.linspace(0.05, 4.0, k, device=DEV).to(BF16)  # runs of different ranges
        runs = x.float().unflatten(-1, (-1, tile))
        scale = runs.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448.0
        xq = ((runs / scale).to(fp8_ops.FP8).float() * scale).flatten(-2)
        out = op(x, None)
        assert _rel_err(out, F.linear(xq, dense)) < 5e-3, f"m={m}"
        assert _rel_err(out, F.linear(x.float(), dense)) > 5e-3, f"m={m}: x was not quantized"
        assert not op.counters.any()


@pytest.mark.parametrize("label", ["torch8", "torch2"])
@pytest.mark.parametrize("role", SHAPES)
def test_int4_through_a_library_peer(role: str, label: str, default_settings: pytest.MonkeyPatch) -> None:
    """`int4=torchN` (torch's own int4 GEMM, tinygemm): repacked from rxf's words at load, 1-16 rows,
    against the dequantized matmul (its offsets in bf16: the same 1% bound), and replayed in a graph."""
    default_settings.setenv(qgemv.ENV, f"int4={label}")
    qgemv._plan.cache_clear()
    op, dense = _layer("int4", role, torch.Generator(device=DEV).manual_seed(4))
    assert op is not None and op.label == label
    k = SHAPES[role][1]
    for m in (1, 2, 8, 16):
        x = _x(m, k, m)
        assert op.takes(x) and _rel_err(op(x, None), F.linear(x.float(), dense)) < 1e-2, f"m={m}"
    assert not op.takes(_x(17, k, 0)) and not op.takes(_x(1, k, 0).half())
    static_x = _x(4, k, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op(static_x, None)
    static_x.copy_(_x(4, k, 7))
    graph.replay()
    torch.testing.assert_close(static_out, op(static_x, None), rtol=0, atol=0)


@pytest.mark.parametrize("label", ["auto", "rn128k128s0st1w4"])
def test_int4_gemv_in_float16(label: str, default_settings: pytest.MonkeyPatch) -> None:
    """fp16 activations and scales: the tile kernel's unpacking then uses fp16's magic (1024 + code) and
    packed fp16 subtraction, the row kernel its float32 words; o_proj's shape, 1-8 rows."""
    default_settings.setenv(qgemv.ENV, f"int4={label}")
    qgemv._plan.cache_clear()
    gen = torch.Generator(device=DEV).manual_seed(5)
    n, k = SHAPES["o_proj"]
    codes = torch.randint(0, 16, (k, n), device=DEV, dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (k // 128, n), device=DEV, generator=gen).half()
    scales = (torch.rand(k // 128, n, device=DEV, generator=gen) * 2e-3 + 1e-4).half()
    dense = Int4Weights(codes, zeros, scales, torch.arange(k, device=DEV) // 128).dequantize(torch.float32)
    op = qgemv.int4(SimpleNamespace(qweight=pack_int32(codes, 0), scales=scales, zeros=zeros, gemv_role="o_proj"), 128)
    for m in (1, 2, 8):
        x = _x(m, k, m).half()
        out = op(x, None)
        assert out.dtype == torch.float16 and _rel_err(out, F.linear(x.float(), dense)) < 1e-2, f"m={m}"


# ---------------------------------------------------------------- quantized checkpoints at decode
CASES = {"fp8": ("fp8", {}), "ct-channel": ("ct-channel", {}), "ct-tensor-static": ("ct-tensor", {"static": True}),
         "awq": ("awq", {}), "gptq-desc-act": ("gptq", {"desc_act": True})}


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), seed=3, initializer_range=0.1, hidden_size=128,
                                intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def _decode_step(harness: ModelHarness, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(graph-replayed, eager) logits of one decode step of token 11 after each prompt."""
    runner = harness.runner
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    runner.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in prompts for t in p], [0] * len(prompts),
                              lens, runner.token_to_kv_pool.alloc(sum(lens))))
    decode = ModelInput(ForwardMode.DECODE, rows, [11] * len(prompts), lens, [1] * len(prompts),
                        runner.token_to_kv_pool.alloc(len(prompts)))
    replayed = runner.forward(decode).clone()
    graphs, runner.cuda_graphs = runner.cuda_graphs, None
    try:
        eager = runner.forward(decode).clone()  # the same step again, eagerly
    finally:
        runner.cuda_graphs = graphs
    return replayed, eager


# The tile kernel at every batch (ALL_AUTO), or at batch 1 the row kernel, which takes the SiLU·mul after
# gate/up into its launch here in every format (`QuantGemv.activated`).
ROW_LABELS = "fp8=rn32k128s0st1w4,fp8-block=rn32k128s0st1w4,int4=rn32k128s0st1w2"
# FP8 at batch 1 through the TMA-fed row kernel (`qgemv_tma_kernel`); gate/up, with the SiLU·mul in its
# launch here, through the register-fed row kernel at the same tiles.
TMA_LABELS = "fp8=trn32k128s0st3w4,fp8-block=trn32k128s0st3w4,int4=rn32k128s0st1w2"


@pytest.mark.parametrize("settings", [ALL_AUTO, ROW_LABELS, TMA_LABELS], ids=["tile", "row", "tma"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_checkpoint_decodes_through_the_gemv(dense_checkpoint, tmp_path, case, settings,
                                                        monkeypatch) -> None:
    monkeypatch.setenv(qgemv.ENV, settings)
    monkeypatch.setenv(qgemv.GATED_ENV, ",".join(qgemv.FORMATS))
    qgemv._plan.cache_clear()
    qgemv._gated_formats.cache_clear()
    fmt, opts = CASES[case]
    q = quantize_checkpoint(dense_checkpoint, tmp_path / "q", fmt, twin=tmp_path / "twin", **opts)
    harness = ModelHarness(q, "triton", **{"runtime.device": "cuda", "model.dtype": "bfloat16"})
    assert harness.runner.cuda_graphs is not None
    layers = harness.runner.model.model.layers[0]
    for layer in (layers.self_attn.qkv_proj, layers.self_attn.o_proj, layers.mlp.gate_up_proj, layers.mlp.down_proj):
        assert layer.quant is not None and layer.qgemv is not None, type(layer).__name__
    calls = []
    call = qgemv.QuantGemv.__call__
    monkeypatch.setattr(qgemv.QuantGemv, "__call__", lambda self, x, bias, **kw: calls.append(
        (x.shape, kw.get("gated", False))) or call(self, x, bias, **kw))
    ref = HFReference(tmp_path / "twin")
    # At most 8 prompt tokens in all, so the prefill also runs the GEMV: no FP8 activation
    # quantization anywhere in what the decode step reads.
    for lengths in ([5], [3, 2, 3], [1] * 8):
        bs = len(lengths)
        prompts = [[(37 * i + 5 * j) % 390 + 5 for j in range(n)] for i, n in enumerate(lengths)]
        calls.clear()
        replayed, eager = _decode_step(harness, prompts)
        assert any(shape == (bs, 128) for shape, _ in calls), "the eager decode step ran the quantized GEMV"
        if settings == ROW_LABELS and bs == 1 and case != "gptq-desc-act":  # (its input order: unfused)
            assert (torch.Size([1, 128]), True) in calls, "gate/up and its SiLU·mul in one launch"
        torch.testing.assert_close(replayed, eager, rtol=0, atol=2e-2 * eager.abs().max().item())
        for i, prompt in enumerate(prompts):
            expected = ref.logits(prompt + [11])[-1]
            assert _rel_err(eager[i].cpu(), expected) < 0.05, f"bs={bs} request {i}"
