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
