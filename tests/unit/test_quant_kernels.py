"""The quantized layers' Triton kernels on CPU under the Triton interpreter, in float16 on tiny shapes,
against the dequantized matmul in float32 (tests/gpu/test_quantization_gpu.py runs them compiled).

The interpreter has no FP8 dot, so the block-scaled GEMM gets float16 stand-ins holding FP8 values
(exact: every E4M3 value is a float16), and the activation quantization kernel writes float32
(the interpreter's own float-to-FP8 conversion rounds differently from the GPU's and torch's: 126.97
became 64), which torch then rounds to FP8.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_quantization_gpu.py covers the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.quantization import fp8_ops  # noqa: E402
from rxf.plugins.quantization.fp8_kernels import block_scaled_mm, per_token_group_quant  # noqa: E402
from rxf.plugins.quantization.int4 import Int4Weights, pack_int32  # noqa: E402
from rxf.plugins.quantization.int4_kernel import int4_linear  # noqa: E402


@pytest.mark.parametrize(("m", "k", "group"), [(3, 256, 128), (2, 200, 64), (1, 96, 96), (2, 4224, 128)])
def test_activation_quant_kernel_matches_the_torch_path(m, k, group):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    q, scale = per_token_group_quant(x, group, out_dtype=torch.float32)
    ref_q, ref_scale = fp8_ops.quantize_per_token(x, group)
    torch.testing.assert_close(scale, ref_scale)
    assert q.abs().max() <= 448
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), ref_q.float())


def test_activation_quant_kernel_pads_rows_and_stores_scales_column_major():
    # cuBLAS's block-scaled GEMM reads the scales as [groups, rows'] with rows' a multiple of 4.
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(5))
    q, scale = per_token_group_quant(x, 128, out_dtype=torch.float32, pad_rows=4, column_major=True)
    ref_q, ref_scale = fp8_ops.quantize_per_token(x, 128)
    assert q.shape == (8, 384) and scale.shape == (8, 3) and scale.stride() == (1, 8)
    torch.testing.assert_close(scale[:5], ref_scale)
    assert torch.equal(q[:5].to(torch.float8_e4m3fn).float(), ref_q.float())
    assert torch.equal(q[5:], torch.zeros(3, 384)) and bool(torch.isfinite(scale[5:]).all())


@pytest.mark.parametrize(("group", "k"), [(128, 256), (384, 384)])  # 384: one group per row (per token)
def test_gated_activation_quant_quantizes_silu_mul_output(group, k):
    # x = [gate | up]: the kernel quantizes SiluAndMul's output, rounded to x's dtype first as the
    # unfused layer's output would be, so its codes and scales equal the two-step path's.
    x = (torch.randn(3, 2 * k, generator=torch.Generator().manual_seed(k)) * 4).half()
    q, scale = per_token_group_quant(x, group, out_dtype=torch.float32, gated=True)
    gate, up = x.float().chunk(2, dim=-1)
    ref_q, ref_scale = fp8_ops.quantize_per_token((torch.nn.functional.silu(gate) * up).half(), group)
    torch.testing.assert_close(scale, ref_scale)
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), ref_q.float())


@pytest.mark.parametrize(("m", "n", "k", "block_k"), [(1, 96, 256, 128), (5, 64, 200, 64), (20, 130, 128, 128)])
def test_block_scaled_gemm_matches_the_dequantized_matmul(m, n, k, block_k):
    gen = torch.Generator().manual_seed(m * n)
    w = torch.randn(n, k, generator=gen) * 0.05
    w_q, w_rows = fp8_ops.quantize_rows(w)
    kb = -(-k // block_k)
    w_scale = w_rows[:, None] * (1 + torch.rand(n, kb, generator=gen))  # a different scale per block
    x = torch.randn(m, k, generator=gen)
    x_q, x_scale = fp8_ops.quantize_per_token(x, block_k)
    out = block_scaled_mm(x_q.half(), x_scale, w_q.half(), w_scale, block_k, torch.float32)
    ref = fp8_ops.dequantize_blocks(x_q, x_scale, block_k, torch.float32) @ fp8_ops.dequantize_blocks(
        w_q, w_scale, block_k, torch.float32).t()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize(("m", "group", "split_k"), [(1, 128, 2), (3, 32, 1), (20, 64, 1), (2, 64, 4), (300, 64, None),
                                                    (260, 96, None)])
def test_int4_gemm_matches_the_dequantized_matmul(m, group, split_k):
    # m >= DEQUANT_ROWS: the weight dequantized whole (`int4_dequantize`), then one matmul.
    k, n = 192 if group == 96 else 256, 96
    gen = torch.Generator().manual_seed(m + group)
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    scales = (torch.rand(k // group, n, generator=gen) * 0.02).half()
    weights = Int4Weights(codes, zeros, scales, torch.arange(k) // group)
    x = torch.randn(m, k, generator=gen).half()
    out = int4_linear(x, pack_int32(codes, 0), scales, zeros.half(), group, None, split_k=split_k)
    ref = x.float() @ weights.dequantize(torch.float32).t()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_cublas_scales_pick_per_row_scales_for_few_rows():
    """cuBLAS's two weight-scale forms by the rows of x: per row and block up to ROW_SCALES_MAX_ROWS,
    128 x 128 blocks above; the one form held serves every count."""
    rows, blocks = torch.ones(4, 256), torch.ones(4, 2)
    both = fp8_ops.CublasScales(rows, blocks)
    limit = fp8_ops.ROW_SCALES_MAX_ROWS
    assert both.pick(1) is rows and both.pick(limit) is rows and both.pick(limit + 1) is blocks
    assert fp8_ops.CublasScales(rows, None).pick(4096) is rows
    assert fp8_ops.CublasScales(None, blocks).pick(1) is blocks
    assert fp8_ops.cublas_block_scales(torch.zeros(256, 256).to(fp8_ops.FP8), torch.ones(256, 2), 128, 128) is None, (
        "CPU weights: no cuBLAS")
