"""The weight-only decode GEMV of quantized layers (`quantization/qgemv_kernel.py`) on CPU under the
Triton interpreter (tiny shapes; float16 and float32, the interpreter's bf16 is wrong), against
F.linear on the weight dequantized by each format's own code (`fp8_ops.dequantize_rows/blocks`,
`Int4Weights.dequantize`), and the `RXF_QGEMV` settings. The kernel is reached through the builders
the methods call at load (`qgemv.fp8_rows`, `fp8_blocks`, `int4`) on stand-in layers; a layer only
takes it for CUDA inputs, so tests/gpu/test_quant_gemv_gpu.py covers the methods' use of it.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_quant_gemv_gpu.py covers the compiled kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.quantization import fp8_ops, qgemv  # noqa: E402
from rxf.plugins.quantization.int4 import Int4Weights, pack_int32  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
SPLITS = pytest.mark.parametrize("split", [1, 3], ids=lambda s: f"split{s}")
# The tile kernel (`qgemv_kernel`, 2 stages) and, for one row of x, the row kernel (`qgemv_row_kernel`;
# label prefix r) with two weight tiles read ahead (st2) or one (st1, its default): (prefix, stages).
FORMS = pytest.mark.parametrize("form", [("", 2), ("r", 2), ("r", 1)], ids=["tile", "row", "row-ahead1"])
# FP8 formats also: one row of x through the TMA-fed row kernel (`qgemv_tma_kernel`; prefix t, 3 stages).
FP8_FORMS = pytest.mark.parametrize("form", [("", 2), ("r", 2), ("r", 1), ("tr", 3)],
                                    ids=["tile", "row", "row-ahead1", "tma"])


@pytest.fixture
def qgemv_env(monkeypatch: pytest.MonkeyPatch):
    """Set RXF_QGEMV for the builders (read once per process: the cache is cleared around it)."""

    def set_env(value: str) -> None:
        monkeypatch.setenv(qgemv.ENV, value)
        qgemv._plan.cache_clear()

    yield set_env
    qgemv._plan.cache_clear()
    qgemv._gated_formats.cache_clear()  # (a test may set RXF_QGEMV_GATED)


def _check(op: qgemv.QuantGemv, x: torch.Tensor, bias: torch.Tensor | None, dense: torch.Tensor) -> None:
    """op(x) equals F.linear with the dequantized weight, and a second launch gives the same bits."""
    dtype = x.dtype
    out = op(x, bias)
    expected = F.linear(x.double(), dense.double(), None if bias is None else bias.double()).to(dtype)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    assert not op.counters.any(), "every counter must be back at 0 after a launch"
    assert torch.equal(op(x, bias), out), "the split reduction runs in a fixed order"


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@FP8_FORMS
@SPLITS
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("scales", ["per-channel", "per-tensor"])
@DTYPES
def test_fp8_row_scales(qgemv_env, dtype, scales, m, split, form):
    """N = 40 (a partial column block of 16), K = 256 = 4 tiles of 64: split 3 gives spans of 2,
    2 and an empty one. Per tensor: one scale spread over the rows, as compressed-tensors loads it."""
    label = f"{form[0]}n16k64s{split}st{form[1]}w4"
    qgemv_env(f"fp8={label}")
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(40, 256, generator=gen) * 0.05
    q, scale = fp8_ops.quantize_rows(w)
    if scales == "per-tensor":
        scale = scale.max().expand(40).contiguous()
        q = (w / scale[:, None]).to(fp8_ops.FP8)
    op = qgemv.fp8_rows(SimpleNamespace(weight=q, weight_scale=scale, gemv_role="o_proj"))
    assert op is not None and op.label == label and (op.tma_desc is not None) == (form[0] == "tr")
    bias = torch.randn(40, generator=gen).to(dtype)
    _check(op, _x(m, 256, dtype, m), bias, fp8_ops.dequantize_rows(q, scale, torch.float64))


@FP8_FORMS
@pytest.mark.parametrize("split", [1, 3, 4], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("n", [96, 72], ids=["block-table", "row-table"])
@DTYPES
def test_fp8_block_scales(qgemv_env, dtype, n, split, form):
    """Blocks of 32 x 64 over K = 192. N = 96: each run of 32 rows shares its scales, so the kernel
    reads the checkpoint's one scale per block; N = 72 (not a multiple of 32): one row of scales per
    output row. The label's k128 shrinks to the 64-input scale block. Split 4: spans of one tile and
    an empty one, whose block scales (past the table's end) must not be read."""
    qgemv_env(f"fp8-block:qkv_proj={form[0]}n16k128s{split}st{form[1]}w4")
    gen = torch.Generator().manual_seed(n)
    q, _ = fp8_ops.quantize_rows(torch.randn(n, 192, generator=gen) * 0.05)
    blocks = torch.rand(-(-n // 32), 3, generator=gen) * 1e-3 + 1e-4  # one scale per 32 x 64 block
    scale_inv = blocks.repeat_interleave(32, dim=0)[:n].contiguous()  # one row per output row (fp8_ops)
    op = qgemv.fp8_blocks(SimpleNamespace(weight=q, weight_scale_inv=scale_inv, gemv_role="qkv_proj"), 32, 64)
    assert op is not None and op.settings.block_k == 64 and (op.tma_desc is not None) == (form[0] == "tr")
    assert (op.scale_rows, tuple(op.scales.shape)) == ((32, (3, 3)) if n == 96 else (1, (72, 3)))
    _check(op, _x(1 if form[0] else 5, 192, dtype, n), None, fp8_ops.dequantize_blocks(q, scale_inv, 64, torch.float64))


def _on_fp8_grid(m: int, k: int, tile: int, gen: torch.Generator) -> torch.Tensor:
    """x `[m, k]` in float16 whose runs of `tile` inputs are E4M3 values times a power of two of their
    own, each run holding a +-448 (E4M3's largest): scaling a run by its largest magnitude / 448 then
    lands every input on the E4M3 grid, so the `x` settings' quantization is exact and F.linear is
    the reference. (The Triton interpreter rounds some float32 -> E4M3 conversions wrongly at a carry
    into the exponent, -7.86 -> -4; the GPU's cvt does not: off-grid inputs are tests/gpu's.)"""
    q = (torch.randn(m, k // tile, tile, generator=gen) * 40).to(fp8_ops.FP8).float()
    q[:, :, 0] = 448.0 * torch.sign(torch.randn(m, k // tile, generator=gen))
    powers = 2.0 ** torch.randint(-6, 3, (m, k // tile, 1), generator=gen)
    return (q * powers).flatten(-2).half()


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_x_quantizes_each_row_per_k_tile(qgemv_env, fmt, m):
    """Label prefix x: x in E4M3 per row and K tile (64 here; each run with a scale of its own), the
    dot FP8 x FP8. One scale per row instead of per tile would round the runs of smaller range."""
    qgemv_env(f"{fmt}=xn32k64s2st2w4")
    gen = torch.Generator().manual_seed(m)
    n, k = 64, 256
    q, scale = fp8_ops.quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    if fmt == "fp8":
        op = qgemv.fp8_rows(SimpleNamespace(weight=q, weight_scale=scale, gemv_role="o_proj"))
        dense = fp8_ops.dequantize_rows(q, scale, torch.float64)
    else:
        blocks = (torch.rand(n // 32, k // 64, generator=gen) + 0.5) * scale.mean()
        per_row = blocks.repeat_interleave(32, dim=0).contiguous()
        op = qgemv.fp8_blocks(SimpleNamespace(weight=q, weight_scale_inv=per_row, gemv_role="o_proj"), 32, 64)
        dense = fp8_ops.dequantize_blocks(q, per_row, 64, torch.float64)
    assert op is not None and op.fp8_x and op.settings.block_k == 64
    _check(op, _on_fp8_grid(m, k, 64, gen), None, dense)


@FORMS
@SPLITS
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m", [1, 8, 16])
@DTYPES
def test_int4(qgemv_env, dtype, m, group, split, form):
    """Codes in rxf's CUDA layout (int32 [K / 8, N], input 8r + j in nibble j), zero points 0..15
    and scales per group; N = 48 (a partial column block of 32), K = 256. Groups of 128 in half
    precision take the tile kernel's dot per nibble position, groups of 32 its unpacked tile."""
    qgemv_env(f"int4={form[0]}n32k128s{split}st{form[1]}w4")
    k, n = 256, 48
    gen = torch.Generator().manual_seed(m + group)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 1e-3).to(dtype)
    layer = SimpleNamespace(qweight=pack_int32(codes, 0), scales=scales, zeros=zeros.to(dtype),
                            gemv_role="down_proj")
    op = qgemv.int4(layer, group)
    assert op is not None and op.settings.block_k == min(128, group)
    bias = torch.randn(n, generator=gen).to(dtype)
    dense = Int4Weights(codes, zeros, scales.to(dtype), torch.arange(k) // group).dequantize(torch.float64)
    _check(op, _x(m, k, dtype, m), bias, dense)


def _gate_up_layer(fmt: str, dtype: torch.dtype, n_out: int, k: int, gen: torch.Generator):
    """(a stand-in gate/up layer of `fmt` with 2 * n_out rows, its GEMV, the dense weight in float64)."""
    if fmt == "int4":
        codes = torch.randint(0, 16, (k, 2 * n_out), generator=gen, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (k // 128, 2 * n_out), generator=gen).float()
        scales = (torch.rand(k // 128, 2 * n_out, generator=gen) * 0.02 + 1e-3).to(dtype)
        layer = SimpleNamespace(qweight=pack_int32(codes, 0), scales=scales, zeros=zeros.to(dtype),
                                gemv_role="gate_up_proj")
        dense = Int4Weights(codes, zeros, scales, torch.arange(k) // 128).dequantize(torch.float64)
        return layer, qgemv.int4(layer, 128), dense
    q, scale = fp8_ops.quantize_rows(torch.randn(2 * n_out, k, generator=gen) * 0.05)
    if fmt == "fp8":
        layer = SimpleNamespace(weight=q, weight_scale=scale, gemv_role="gate_up_proj")
        return layer, qgemv.fp8_rows(layer), fp8_ops.dequantize_rows(q, scale, torch.float64)
    blocks = torch.rand(-(-2 * n_out // 32), k // 64, generator=gen) * 1e-3 + 1e-4  # 32 x 64 blocks
    scale_inv = blocks.repeat_interleave(32, dim=0)[: 2 * n_out].contiguous()
    layer = SimpleNamespace(weight=q, weight_scale_inv=scale_inv, gemv_role="gate_up_proj")
    return layer, qgemv.fp8_blocks(layer, 32, 64), fp8_ops.dequantize_blocks(q, scale_inv, 64, torch.float64)


@pytest.mark.parametrize("ahead_split", [(1, 1), (2, 3)], ids=["st1-split1", "st2-split3"])
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int4"])
@DTYPES
def test_row_kernel_takes_the_silu_mul_in(qgemv_env, monkeypatch, dtype, fmt, ahead_split):
    """`QuantGemv.activated` at one row of x: SiLU·mul of the `[gate | up]` output in the GEMV's launch
    (each program dots block_n / 2 gate rows and the matching up rows, n_out on), against F.linear with
    the dequantized weight and silu(gate) * up in float64. n_out 48 over block-wise FP8's 32-row scale
    blocks: the up rows start inside a block (the table of one scale per block). Formats left out of
    `RXF_QGEMV_GATED`, and two rows, keep the separate launch."""
    from rxf.plugins.models.layers.activation import SiluAndMul

    monkeypatch.setenv(qgemv.GATED_ENV, fmt)
    qgemv._gated_formats.cache_clear()
    ahead, split = ahead_split
    qgemv_env(f"{fmt}=rn32k{128 if fmt == 'int4' else 64}s{split}st{ahead}w4")
    k, n_out = 256, 40 if fmt == "fp8" else 48
    gen = torch.Generator().manual_seed(split + n_out)
    _, op, dense = _gate_up_layer(fmt, dtype, n_out, k, gen)
    assert op is not None and op.settings.row and (fmt != "fp8-block" or op.scale_rows == 32)
    x = _x(1, k, dtype, 1)
    bias = torch.randn(2 * n_out, generator=gen).to(dtype)
    act = SiluAndMul()
    out = op.activated(x, bias, act)
    y = F.linear(x.double(), dense, bias.double())
    expected = (F.silu(y[:, :n_out]) * y[:, n_out:]).to(dtype)
    assert out.shape == (1, n_out)
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    assert not op.counters.any(), "every counter must be back at 0 after a launch"
    assert torch.equal(op.activated(x, bias, act), out), "the split reduction runs in a fixed order"
    assert op.activated(_x(2, k, dtype, 3), bias, act) is None, "two rows: the tile kernel, which does not take it"
    monkeypatch.setenv(qgemv.GATED_ENV, "none")
    qgemv._gated_formats.cache_clear()
    assert op.activated(x, bias, act) is None


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block"])
def test_tma_setting_gates_through_the_register_row_kernel(qgemv_env, monkeypatch, fmt):
    """A TMA label (prefix t) of a format in `RXF_QGEMV_GATED`: batch 1's projection runs the TMA kernel,
    its gate/up with the SiLU·mul in the launch the register-fed row kernel at the same tiles (the TMA
    kernel has no gated form); both against F.linear with the dequantized weight in float64."""
    from rxf.plugins.models.layers.activation import SiluAndMul
    from rxf.plugins.quantization import qgemv_tma_kernel

    monkeypatch.setenv(qgemv.GATED_ENV, fmt)
    qgemv._gated_formats.cache_clear()
    qgemv_env(f"{fmt}=trn32k64s2st3w4")
    k, n_out = 256, 40 if fmt == "fp8" else 48
    _, op, dense = _gate_up_layer(fmt, torch.float16, n_out, k, torch.Generator().manual_seed(5))
    assert op is not None and op.tma_desc is not None
    tma_launches = []
    launch = qgemv_tma_kernel.qgemv_tma
    monkeypatch.setattr(qgemv_tma_kernel, "qgemv_tma", lambda *a, **kw: tma_launches.append(1) or launch(*a, **kw))
    x = _x(1, k, torch.float16, 1)
    y = F.linear(x.double(), dense)
    out = op.activated(x, None, SiluAndMul())
    expected = (F.silu(y[:, :n_out]) * y[:, n_out:]).half()
    torch.testing.assert_close(out, expected, rtol=TOL[torch.float16], atol=TOL[torch.float16])
    assert not tma_launches, "the gated launch is the register-fed kernel's"
    torch.testing.assert_close(op(x, None), y.half(), rtol=TOL[torch.float16], atol=TOL[torch.float16])
    assert tma_launches == [1]


def test_tma_descriptor_refuses_layouts_tma_cannot_read():
    """TMA reads 16-byte aligned starts and row strides and boxes of 16 bytes or more, rows of whole
    int32 words: anything else is a ValueError (`QuantGemv` then keeps the register row kernel)."""
    from rxf.plugins.quantization.qgemv_tma_kernel import weight_descriptor

    w = torch.zeros(32, 80, dtype=fp8_ops.FP8)  # rows of 80 bytes
    assert list(weight_descriptor(w[:, :64], 16, 64).block_shape) == [16, 16]
    for view, block_k in ((w[:, 4:], 64), (w[:, :78], 64), (w, 8), (w.view(64, 40), 32)):
        with pytest.raises(ValueError, match="16-byte"):
            weight_descriptor(view, 16, block_k)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "int4"])
def test_shape_defaults_where_rxf_qgemv_is_silent(qgemv_env, monkeypatch, fmt):
    """On sm_90 (here pretended), a layer of a shape in `SHAPE_DEFAULTS` takes its measured label when
    `RXF_QGEMV` does not name the format, any other shape `BY_DEFAULT`'s; a named format (`auto`)
    keeps its own. The GPU twin: tests/gpu/test_quant_gemv_gpu.py."""
    monkeypatch.setattr(qgemv, "_sm90", lambda device: True)
    monkeypatch.setattr(qgemv, "SHAPE_DEFAULTS", {(fmt, 64, 256): "rn32k128s3st1w2"})

    def build(n):
        if fmt == "int4":
            layer = SimpleNamespace(qweight=torch.zeros(256 // 8, n, dtype=torch.int32), scales=torch.ones(2, n).half(),
                                    zeros=torch.zeros(2, n).half(), gemv_role="o_proj")
            return qgemv.int4(layer, 128)
        w = torch.zeros(n, 256).to(fp8_ops.FP8)
        if fmt == "fp8":
            return qgemv.fp8_rows(SimpleNamespace(weight=w, weight_scale=torch.ones(n), gemv_role="o_proj"))
        return qgemv.fp8_blocks(SimpleNamespace(weight=w, weight_scale_inv=torch.ones(n, 2), gemv_role="o_proj"),
                                128, 128)

    qgemv_env("")
    assert build(64).label == "rn32k128s3st1w2"
    assert build(96).settings.num_warps == qgemv.BY_DEFAULT[fmt][0].tiles.num_warps and build(96).settings.row
    qgemv_env(f"{fmt}=auto")
    assert not build(64).settings.row


def test_int4_needs_integer_zero_points(qgemv_env):
    qgemv_env("int4=auto")
    layer = SimpleNamespace(qweight=torch.zeros(8, 16, dtype=torch.int32), scales=torch.ones(1, 16).half(),
                            zeros=torch.full((1, 16), 7.5).half())
    assert qgemv.int4(layer, 64) is None, "7.5 - a code is not exact in half precision"


def test_settings_from_the_environment(qgemv_env, monkeypatch):
    weight, scale = torch.zeros(64, 512, dtype=fp8_ops.FP8), torch.ones(64)
    qgemv_env("fp8=n32k128s2st3w4, fp8:down_proj=off,int4:o_proj=auto")
    assert qgemv.settings_for("fp8", "qkv_proj")[0].label == "n32k128s2st3w4"
    assert qgemv.settings_for("fp8", "down_proj") is None
    assert qgemv.settings_for("int4", "o_proj") == (qgemv.QuantSettings(qgemv.DEFAULTS["int4"]), 16), "the tile's rows"
    assert qgemv.settings_for("fp8", "qkv_proj")[1] == qgemv.MAX_ROWS
    assert qgemv.settings_for("fp8-block", None) == qgemv.BY_DEFAULT["fp8-block"], "unnamed: BY_DEFAULT's"
    assert qgemv.fp8_rows(SimpleNamespace(weight=weight, weight_scale=scale, gemv_role="down_proj")) is None
    op = qgemv.fp8_rows(SimpleNamespace(weight=weight, weight_scale=scale, gemv_role="gate_up_proj"))
    assert op is not None and op.counters.tolist() == [0, 0]
    assert not op.takes(torch.zeros(1, 512, dtype=torch.bfloat16)), "CPU inputs keep the method's path"
    # K = 8 * 3 has no power-of-two tile of 16 inputs or more: the method's GEMM serves the layer.
    assert qgemv.fp8_rows(SimpleNamespace(weight=weight[:, :24], weight_scale=scale)) is None
    qgemv_env("int4=auto")
    settings, rows = qgemv.settings_for("fp8", "qkv_proj")
    assert settings.tiles.row and rows == 1, "FP8 row scales: the row kernel at batch 1 unless the variable says otherwise"
    op = qgemv.fp8_rows(SimpleNamespace(weight=weight, weight_scale=scale, gemv_role="o_proj"))
    assert op.max_rows == 1 and op.settings.row and not op.tile.row and op.tile.block_n == qgemv.DEFAULTS["fp8"].block_n
    assert op.counters.numel() == 64 // 32, "counters for the smaller block_n of the two settings"
    qgemv_env("fp8=off")
    assert qgemv.settings_for("fp8", None) is None
    qgemv_env("int4:down_proj=torch4")
    assert qgemv.settings_for("int4", "down_proj")[0].label == "torch4"
    assert qgemv.settings_for("int4", "down_proj")[0].peer == "torch4"
    qgemv_env("fp8=xn64k128s0st4w4")
    assert qgemv.settings_for("fp8", None)[0] == qgemv.QuantSettings(qgemv.GemvSettings.parse("n64k128s0st4w4"), True)
    monkeypatch.setenv(qgemv.GATED_ENV, "int4,fp16")
    qgemv._gated_formats.cache_clear()
    with pytest.raises(ValueError, match=qgemv.GATED_ENV):
        qgemv.fp8_rows(SimpleNamespace(weight=weight, weight_scale=scale, gemv_role="gate_up_proj"))
    monkeypatch.delenv(qgemv.GATED_ENV)
    qgemv._gated_formats.cache_clear()
    for bad in ("fp8", "fp4=auto", "fp8:lm_head=auto", "int4=n48k128s1st4w4", "int4=fast", "int4=xn32k128s1st4w4",
                "fp8=xrn16k256s0st1w8", "fp8=torch8", "int4=torch16", "fp8=tn16k64s1st3w4", "fp8=trn16k64s1st1w4",
                "int4=trn128k128s0st2w4", "fp8=txn16k64s1st3w4"):
        qgemv_env(bad)
        with pytest.raises(ValueError, match=qgemv.ENV):
            qgemv.settings_for("int4", None)
