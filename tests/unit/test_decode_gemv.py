"""The decode GEMV (`layers/gemv_kernel.py`) against torch, on CPU under the Triton interpreter (tiny
shapes), and the `RXF_GEMV` settings. As in test_triton_attention.py, TRITON_INTERPRET is set before
the kernel module is imported, and the module is skipped where CUDA is present (tests/gpu covers the
compiled kernel there)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_decode_kernels_gpu.py covers the compiled kernel",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.models.layers import gemv as gemv_mod  # noqa: E402
from rxf.plugins.models.layers.gemv import GemvSettings  # noqa: E402
from rxf.plugins.models.layers.gemv_kernel import gemv  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def _data(m: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def _run(x, w, b, split_k: int, block_n: int = 16, block_k: int = 32, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    n_out = w.shape[0] // (2 if kw.get("gated") else 1)
    counters = torch.zeros(-(-n_out // block_n), dtype=torch.int32)
    out = gemv(x, w, b, counters, block_n, block_k, split_k, num_stages=2, num_warps=4, **kw)
    return out, counters


@pytest.mark.parametrize("split_k", [1, 2, 4], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("m", [1, 3, 8])
@DTYPES
def test_matches_linear(dtype: torch.dtype, m: int, split_k: int) -> None:
    """N = 40 (a partial column block), K = 160 = 5 tiles of 32: split 2 gives 3 + 2 tiles, split 4
    spans of 2 tiles (2, 2, 1, and one empty split)."""
    x, w, b = _data(m, 40, 160, dtype, bias=True)
    out, counters = _run(x, w, b, split_k)
    expected = F.linear(x.double(), w.double(), b.double()).to(dtype)
    assert out.shape == (m, 40) and out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    assert not counters.any(), "every counter must be back at 0 after a launch"
    again, _ = _run(x, w, b, split_k)
    assert torch.equal(again, out), "the split reduction runs in a fixed order"


@pytest.mark.parametrize("split_k", [1, 3], ids=lambda s: f"split{s}")
@DTYPES
def test_gated_is_silu_and_mul_of_gate_up(dtype: torch.dtype, split_k: int) -> None:
    x, w, b = _data(2, 2 * 48, 96, dtype, bias=True)
    out, counters = _run(x, w, b, split_k, gated=True)
    gate, up = F.linear(x.double(), w.double(), b.double()).chunk(2, dim=-1)
    torch.testing.assert_close(out, (F.silu(gate) * up).to(dtype), rtol=TOL[dtype], atol=TOL[dtype])
    assert not counters.any()


def test_float32_output_without_bias() -> None:
    """The lm_head form: half-precision inputs, float32 logits, no rounding to half in between."""
    x, w, _ = _data(4, 64, 128, torch.float16, bias=False)
    out, _ = _run(x, w, None, 2, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    rows = torch.full((6, 64), float("nan"))  # the rows a CUDA-graph capture hands the head
    for row in (False, True):
        fresh, _ = _run(x[:1], w, None, 2, out_dtype=torch.float32, row=row)
        given, _ = _run(x[:1], w, None, 2, out_dtype=torch.float32, row=row, out=rows[:1])
        assert given.data_ptr() == rows.data_ptr() and torch.equal(given, fresh) and rows[1:].isnan().all()
    given, _ = _run(x, w, None, 2, out_dtype=torch.float32, out=rows[:4])
    assert torch.equal(given, out) and rows[4:].isnan().all()
    with pytest.raises(AssertionError, match="out"):
        _run(x, w, None, 2, out_dtype=torch.float32, out=rows[:3])


def test_rejects_shapes_it_cannot_serve() -> None:
    x, w, _ = _data(17, 32, 64, torch.float32, bias=False)
    with pytest.raises(AssertionError, match="at most 16"):
        _run(x, w, None, 1)
    with pytest.raises(AssertionError, match="multiple of block_k"):
        _run(x[:2, :48], w[:, :48], None, 1)


def test_settings_labels_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    s = GemvSettings.parse("n64k128s4st3w8")
    assert (s.block_n, s.block_k, s.split_k, s.num_stages, s.num_warps) == (64, 128, 4, 3, 8)
    assert s.label == "n64k128s4st3w8"
    for bad in ("n48k128s4st3w8", "n64k128s1st0w8", "n64k128s1st3w8p", "fast"):
        with pytest.raises(ValueError):
            GemvSettings.parse(bad)
    # split_k 0: about 2 programs per SM (CPU counts as one SM), at most one K tile each; block_k
    # shrinks to a divisor of K.
    cpu = torch.device("cpu")
    assert GemvSettings(block_n=32, block_k=256, split_k=0).resolve(32, 1024, cpu).split_k == 2
    assert GemvSettings(block_n=32, block_k=256, split_k=0).resolve(32, 256, cpu).split_k == 1
    assert GemvSettings(block_k=256, split_k=3).resolve(64, 96, cpu).label == "n32k32s3st4w4"

    weight = torch.empty(64, 128)
    monkeypatch.setenv(gemv_mod.ENV, "qkv_proj=n32k64s2st2w4, o_proj=triton,lm_head=cublas")
    gemv_mod._from_env.cache_clear()
    try:
        qkv = gemv_mod.decode_gemv("qkv_proj", weight)
        assert qkv is not None and qkv.settings.label == "n32k64s2st2w4" and qkv.counters.tolist() == [0, 0]
        assert gemv_mod.decode_gemv("o_proj", weight) is not None
        assert gemv_mod.decode_gemv("lm_head", weight) is None and gemv_mod.decode_gemv("down_proj", weight) is None
        assert not qkv.applies(torch.empty(1, 128)), "CPU tensors keep the torch path"
        monkeypatch.setenv(gemv_mod.ENV, "cublas,o_proj=rn16k64s1st1w4")  # a bare setting: every role not named
        gemv_mod._from_env.cache_clear()
        assert gemv_mod.decode_gemv("qkv_proj", weight) is None and gemv_mod.decode_gemv("lm_head", weight) is None
        assert gemv_mod.decode_gemv("o_proj", weight).settings.label == "rn16k64s1st1w4"
        assert not gemv_mod.decode_gemv("o_proj", weight).graphs_only  # named: eager steps too
        monkeypatch.delenv(gemv_mod.ENV)  # unset: by device, and a CPU weight's is cuBLAS
        gemv_mod._from_env.cache_clear()
        assert all(gemv_mod.decode_gemv(role, weight) is None for role in gemv_mod.ROLES)
        # A device's default (Hopper's) serves inside CUDA graphs only.
        monkeypatch.setattr(gemv_mod, "device_default", lambda shape, dtype, hopper: GemvSettings())
        assert all(gemv_mod.decode_gemv(role, weight).graphs_only for role in gemv_mod.ROLES)
        for bad in ("qkv=triton", "o_proj=n64", "n64", "cublas=o_proj"):
            monkeypatch.setenv(gemv_mod.ENV, bad)
            gemv_mod._from_env.cache_clear()
            with pytest.raises(ValueError, match=gemv_mod.ENV):
                gemv_mod.decode_gemv("o_proj", weight)
    finally:
        gemv_mod._from_env.cache_clear()


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("split_k", [1, 3], ids=lambda s: f"split{s}")
@DTYPES
def test_row_kernel_matches_the_tile_kernel(dtype: torch.dtype, split_k: int, gated: bool) -> None:
    """Batch 1 through `gemv_row_kernel` (`row=True`) against F.linear, with a K split over uneven spans
    (K = 160: 5 tiles of 32, split 3 gives 2, 2, 1), the partial column block of N = 40, SiLU·mul and
    float32 output."""
    n_out, k = 40, 160
    _, w, b = _data(1, 2 * n_out if gated else n_out, k, dtype, bias=True)
    h = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out, counters = _run(h, w, b, split_k, gated=gated, row=True)
    expected = F.linear(h.double(), w.double(), b.double())
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    torch.testing.assert_close(out, expected.to(dtype), rtol=TOL[dtype], atol=TOL[dtype])
    assert not counters.any()
    wide, _ = _run(h, w, None, 2, out_dtype=torch.float32, row=True)
    torch.testing.assert_close(wide, F.linear(h.double(), w.double()).float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_row_setting_label() -> None:
    s = GemvSettings.parse("rn16k512s2st1w8")
    assert s.row and (s.block_n, s.block_k, s.split_k, s.num_warps) == (16, 512, 2, 8) and s.label == "rn16k512s2st1w8"
    assert not GemvSettings.parse("n16k512s2st1w8").row


def test_split_zero_in_a_label_is_chosen_from_the_shape() -> None:
    s = GemvSettings.parse("rn16k256s0st1w8")
    assert s.row and s.split_k == 0 and s.label == "rn16k256s0st1w8"
    # CPU: one SM; one column block; the row kernel wants 5 programs a SM, the tile kernel 2
    assert s.resolve(16, 1024, torch.device("cpu")).split_k == 4  # at most one K tile a program
    assert s.resolve(16, 4096, torch.device("cpu")).split_k == 5
    assert GemvSettings.parse("n16k256s0st1w8").resolve(16, 4096, torch.device("cpu")).split_k == 2


def test_device_default_by_shape() -> None:
    """Hopper: the measured label for a shape in SHAPE_DEFAULTS (each one a valid setting, of the row
    kernel or the tile kernel, that divides its K), `triton`'s tiles for other shapes; half precision
    only; other GPUs: cuBLAS."""
    for (n, k), label in gemv_mod.SHAPE_DEFAULTS.items():
        s = gemv_mod.device_default((n, k), torch.bfloat16, hopper=True)
        assert s is not None and s.label == label and s.row == label.startswith("r") and k % s.block_k == 0
        assert gemv_mod.device_default((n, k), torch.float16, hopper=True) == s
        assert gemv_mod.device_default((n, k), torch.float32, hopper=True) is None
        assert gemv_mod.device_default((n, k), torch.bfloat16, hopper=False) is None
    assert gemv_mod.device_default((6144, 4096), torch.bfloat16, hopper=True) == GemvSettings()  # Llama-3-8B's qkv
