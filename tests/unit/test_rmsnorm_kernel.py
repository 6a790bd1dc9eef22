"""The decode RMSNorm kernel (`layers/rmsnorm_kernel.py`) against its numerics in torch
(`rxf.testing.norm_reference`, FlashInfer's) for Llama's and Gemma's norms, on CPU under the Triton interpreter (skipped where CUDA is present:
tests/gpu/test_decode_kernels_gpu.py covers the compiled kernel and its PDL launch)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_decode_kernels_gpu.py covers the compiled kernel",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.models.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm  # noqa: E402
from rxf.testing.norm_reference import rmsnorm_reference  # noqa: E402

TOL = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm], ids=["llama", "gemma"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "add"])
def test_matches_the_reference(dtype: torch.dtype, cls: type[RMSNorm], with_residual: bool) -> None:
    """3 rows of hidden 96 (a padded block of 128), weights away from 1, eps 1e-5."""
    gen = torch.Generator().manual_seed(7)
    norm = cls(96, eps=1e-5, dtype=dtype)
    norm.weight.data = (torch.randn(96, generator=gen) * 0.5 + (0.0 if cls is GemmaRMSNorm else 1.0)).to(dtype)
    x = (torch.randn(3, 96, generator=gen) * 3).to(dtype)
    res = torch.randn(3, 96, generator=gen).to(dtype) if with_residual else None
    want, want_sum = rmsnorm_reference(x, norm.weight, norm.eps, res, gemma=norm.gemma)
    res_out = None if res is None else res.clone()  # the kernel adds into it in place
    out = rmsnorm(x, norm.weight, norm.eps, res_out, gemma=norm.gemma)
    if with_residual:
        assert torch.equal(res_out, want_sum), "the residual sum is rounded like torch's add"
    torch.testing.assert_close(out, want, rtol=TOL[dtype], atol=TOL[dtype])
    # forward_native (Llama's: normed rounded before the weight multiply) within a rounding step
    native = norm.forward_native(x, res)
    torch.testing.assert_close(out, native[0] if with_residual else native, rtol=2e-3, atol=2e-3)


def test_in_place_over_input_and_residual() -> None:
    """out = x and res_out = residual (FlashInfer's contract, which RMSNorm.forward keeps)."""
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(64, eps=1e-6, dtype=torch.float32)
    x, res = torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen)
    want, want_sum = rmsnorm_reference(x, norm.weight, norm.eps, res)
    rmsnorm(x, norm.weight, norm.eps, res, out=x)
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(res, want_sum)


@pytest.mark.parametrize(("hidden", "group"), [(256, 128), (96, 32), (96, None)], ids=["g128", "partial-row", "per-row"])
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm], ids=["llama", "gemma"])
def test_fp8_output_quantizes_the_normed_row(hidden: int, group: int | None, cls: type[RMSNorm]) -> None:
    """`rmsnorm_fp8`: the fp16 normed row quantized as the activation quantization kernel would
    (`quantize_per_token`'s torch path), padded to 4 rows with column-major scales as cuBLAS reads
    them; the residual sum written in place. The interpreter stores float32 codes (its own FP8
    conversion rounds differently from the GPU's), which torch rounds to FP8 here."""
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm_fp8
    from rxf.plugins.quantization import fp8_ops

    gen = torch.Generator().manual_seed(hidden)
    norm = cls(hidden, eps=1e-5, dtype=torch.float16)
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.5 + 1.0).half()
    x, res = (torch.randn(3, hidden, generator=gen) * 3).half(), torch.randn(3, hidden, generator=gen).half()
    want, want_sum = rmsnorm_reference(x, norm.weight, norm.eps, res, gemma=norm.gemma)
    res_out = res.clone()
    q, scale = rmsnorm_fp8(x, norm.weight, norm.eps, res_out, group, gemma=norm.gemma, pad_rows=4,
                           column_major=True, out_dtype=torch.float32)
    assert torch.equal(res_out, want_sum)
    want_q, want_scale = fp8_ops.quantize_per_token(want, group)
    assert q.shape == (4, hidden) and scale.shape == (4, want_scale.shape[1]) and scale.stride() == (1, 4)
    torch.testing.assert_close(scale[:3], want_scale, rtol=1e-6, atol=0)
    assert torch.equal(q[:3].to(torch.float8_e4m3fn).float(), want_q.float())
    assert torch.equal(q[3:], torch.zeros(1, hidden)) and torch.equal(scale[3:], torch.ones(1, scale.shape[1]))
