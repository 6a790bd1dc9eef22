"""Quantized layers on a GPU (skipped without CUDA), each against a dequantized float32 reference.

- Kernels at Llama-3-8B layer shapes, decode to prefill rows: FP8 activation quantization equals
  the torch path; the block-scaled FP8 GEMM and `torch._scaled_mm` (per-row scales) equal the
  float32 matmul of the dequantized operands to float32-accumulation error (< 1%, bf16 output);
  the int4 GEMM (split-K and not) equals the dequantized bf16 matmul to bf16 error.
- Tiny quantized checkpoints through `ModelRunner` on CUDA in bfloat16 (the layers then compute in
  FP8 / int4): logits near transformers running the dequantized float32 twin. Int4 layers only
  round to bf16 (< 5% of the logits' norm); FP8 layers also quantize activations (3 mantissa bits:
  < 15%, the bound the CPU test gives online FP8's weight rounding on the same model).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from rxf.plugins.quantization import fp8_ops  # noqa: E402
from rxf.plugins.quantization.fp8_kernels import block_scaled_mm, per_token_group_quant  # noqa: E402
from rxf.plugins.quantization.int4 import Int4Weights, pack_int32  # noqa: E402
from rxf.plugins.quantization.int4_kernel import int4_linear  # noqa: E402
from rxf.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from rxf.testing.model_harness import ModelHarness  # noqa: E402
from rxf.testing.quantized_checkpoints import quantize_checkpoint  # noqa: E402
from rxf.testing.reference import HFReference  # noqa: E402

CUDA = torch.device("cuda")
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K): o_proj, gate/up, down


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("m", [1, 8, 300])
def test_activation_quant_matches_torch(m):
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16) * 3
    for group in (128, 4096):
        q, s = per_token_group_quant(x, group)
        xs = x.float().view(m, -1, group)
        # Divided by a tensor: torch divides by a Python number as a product with its reciprocal,
        # one rounding off now and then, and the kernel divides correctly rounded (div_rn).
        amax = xs.abs().amax(-1).clamp(min=1e-12)
        ref_s = amax / torch.full_like(amax, 448)
        assert torch.equal(s, ref_s)
        ref_q = (xs / ref_s[..., None]).clamp(-448, 448).view(m, -1).to(torch.float8_e4m3fn)
        assert torch.equal(q.float(), ref_q.float())


@pytest.mark.parametrize("m", [1, 8, 300])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fp8_gemms_match_the_dequantized_matmul(m, n, k):
    w = torch.randn(n, k, device=CUDA) * 0.02
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    w_q, w_rows = fp8_ops.quantize_rows(w)
    # Per-row scales through torch._scaled_mm, activations per token.
    out = fp8_ops.scaled_mm_rows(x, w_q, w_rows, None, None)
    x_q, x_s = fp8_ops.quantize_per_token(x)
    ref = (x_q.float() * x_s) @ fp8_ops.dequantize_rows(w_q, w_rows, torch.float32).t()
    assert _rel(out, ref) < 1e-2
    # Block scales (one per 128 x 128 block, repeated over each block's rows).
    blocks = (torch.rand(-(-n // 128), k // 128, device=CUDA) + 0.5) * w_rows.mean()
    w_scale = blocks.repeat_interleave(128, 0)[:n]
    out = fp8_ops.block_fp8_linear(x, w_q, w_scale, 128, None)
    xq, xs = fp8_ops.quantize_per_token(x, 128)
    ref = fp8_ops.dequantize_blocks(xq, xs, 128, torch.float32) @ fp8_ops.dequantize_blocks(
        w_q, w_scale, 128, torch.float32).t()
    assert _rel(out, ref) < 1e-2
    # Hopper's FP8 MMA accumulates each 128-wide K block in reduced precision before the kernel's
    # float32 sum over blocks: 1.27e-4 measured at m = 300 on the H200, so 1e-3, not float32's 1e-5.
    assert _rel(block_scaled_mm(xq, xs, w_q, w_scale, 128, torch.float32), ref) < 1e-3


@pytest.mark.parametrize("m", [1, 8, 300])
@pytest.mark.parametrize(("n", "k"), [*SHAPES, (4160, 4096)])  # 4160: rows not in whole 128-row blocks
@pytest.mark.parametrize("choice", ["cublas", "cublas-blocks", "cublas-rows"])
def test_block_fp8_through_cublas_matches_the_dequantized_matmul(m, n, k, choice, monkeypatch):
    """Default "cublas": per-row scales up to 64 rows of x (m 1, 8), 128 x 128 blocks above (m 300)
    where every block's rows share their scales (n 4160 does not: per row at every m)."""
    monkeypatch.setenv("RXF_FP8_BLOCK_GEMM", choice)
    w_q, w_rows = fp8_ops.quantize_rows(torch.randn(n, k, device=CUDA) * 0.02)
    blocks = (torch.rand(-(-n // 128), k // 128, device=CUDA) + 0.5) * w_rows.mean()
    w_scale = blocks.repeat_interleave(128, 0)[:n]
    scale_b = fp8_ops.cublas_block_scales(w_q, w_scale, 128, 128)
    if torch.cuda.get_device_capability() == (9, 0):  # torch >= 2.9 with CUDA >= 12.9 on Hopper
        assert scale_b is not None
    elif scale_b is None:
        pytest.skip("no block-scaled FP8 in this cuBLAS / PyTorch")
    shared = n % 128 == 0
    assert (scale_b.blocks is not None) == (shared and choice != "cublas-rows")
    assert (scale_b.rows is not None) == (not shared or choice != "cublas-blocks")
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    out = fp8_ops.block_fp8_linear(x, w_q, w_scale, 128, None, scale_b)
    xq, xs = fp8_ops.quantize_per_token(x, 128)
    ref = fp8_ops.dequantize_blocks(xq, xs, 128, torch.float32) @ fp8_ops.dequantize_blocks(
        w_q, w_scale, 128, torch.float32).t()
    assert out.shape == (m, n)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("m", [16, 300])
def test_fp8_down_projection_computes_silu_mul_inside_its_quantization(m):
    from rxf.plugins.models.layers.activation import SiluAndMul

    n, k = 4096, 14336
    w_q, w_rows = fp8_ops.quantize_rows(torch.randn(n, k, device=CUDA) * 0.02)
    w_scale = ((torch.rand(n // 128, k // 128, device=CUDA) + 0.5) * w_rows.mean()).repeat_interleave(128, 0)
    x = torch.randn(m, 2 * k, device=CUDA, dtype=torch.bfloat16) * 2
    h = SiluAndMul()(x)
    # The same FP8 codes as quantizing SiluAndMul's output, but for a last-bit difference of its exp
    # now and then (Triton's against FlashInfer's): the products agree to far below FP8's rounding.
    for cublas in (None, fp8_ops.cublas_block_scales(w_q, w_scale, 128, 128)):
        fused = fp8_ops.block_fp8_linear(x, w_q, w_scale, 128, None, cublas, gated=True)
        assert _rel(fused, fp8_ops.block_fp8_linear(h, w_q, w_scale, 128, None, cublas).float()) < 1e-3
    fused = fp8_ops.scaled_mm_rows(x, w_q, w_rows, None, None, gated=True)
    assert _rel(fused, fp8_ops.scaled_mm_rows(h, w_q, w_rows, None, None).float()) < 1e-3


@pytest.mark.parametrize("m", [1, 4, 8, 300])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_int4_gemm_matches_the_dequantized_matmul(m, n, k):
    group = 128
    codes = torch.randint(0, 16, (k, n), device=CUDA, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), device=CUDA).float()
    scales = (torch.rand(k // group, n, device=CUDA) * 0.01).bfloat16()
    dense = Int4Weights(codes, zeros, scales, torch.arange(k, device=CUDA) // group).dequantize(torch.float32)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    ref = x.float() @ dense.t()
    for split in (None, 1):
        out = int4_linear(x, pack_int32(codes, 0), scales, zeros.bfloat16(), group, None, split_k=split)
        assert _rel(out, ref) < 1e-2


CASES = {
    "fp8": ("fp8", {}, 0.15), "ct-channel": ("ct-channel", {}, 0.15), "ct-tensor-static": ("ct-tensor", {"static": True, "input_scale": 0.02}, 0.15),
    "awq": ("awq", {}, 0.05), "gptq-desc-act": ("gptq", {"desc_act": True}, 0.05),
}


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), seed=3, initializer_range=0.1, hidden_size=128,
                                intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_checkpoint_on_cuda_is_near_its_twin(dense_checkpoint, tmp_path, case):
    fmt, opts, bound = CASES[case]
    q = quantize_checkpoint(dense_checkpoint, tmp_path / "q", fmt, twin=tmp_path / "twin", **opts)
    harness = ModelHarness(q, "triton", **{"runtime.device": "cuda", "model.dtype": "bfloat16"})
    layer = harness.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.quant is not None  # computed quantized, not dequantized at load
    ref = HFReference(tmp_path / "twin")
    prompts = [[5, 80, 17, 300, 42, 9, 77, 123], [400, 12, 33]]
    for prompt, ours in zip(prompts, harness.prefill_logits(prompts), strict=True):
        assert _rel(ours.cpu(), ref.logits(prompt)) < bound


@pytest.mark.parametrize("fused", ["gated", "1"])
@pytest.mark.parametrize("case", ["fp8", "ct-channel"])
def test_fused_fp8_inputs_give_the_unfused_logits(dense_checkpoint, tmp_path, case, fused, monkeypatch):
    # RXF_FP8_FUSED_INPUT=gated (the default): SiLU·mul inside the activation quantization; 1: the
    # pre-norms too. The codes are the unfused path's (0) but for a last-bit difference of an exp or
    # rsqrt now and then.
    fmt, opts, _ = CASES[case]
    q = quantize_checkpoint(dense_checkpoint, tmp_path / "q", fmt, **opts)
    prompts = [[5, 80, 17, 300, 42, 9, 77, 123, 4, 8, 15, 16, 23, 42, 99, 100, 3, 7], [400, 12, 33, 2, 9, 1, 60, 61, 62]]
    config = {"runtime.device": "cuda", "model.dtype": "bfloat16"}
    try:  # the setting is read once per process: cleared around each engine
        monkeypatch.setenv("RXF_FP8_FUSED_INPUT", "0")
        fp8_ops._fused_inputs.cache_clear()
        unfused = ModelHarness(q, "triton", **config).prefill_logits(prompts)
        monkeypatch.setenv("RXF_FP8_FUSED_INPUT", fused)
        fp8_ops._fused_inputs.cache_clear()
        out = ModelHarness(q, "triton", **config).prefill_logits(prompts)
    finally:
        fp8_ops._fused_inputs.cache_clear()
    for a, b in zip(out, unfused, strict=True):
        assert _rel(a, b.float()) < 2e-2


@pytest.mark.parametrize("group", [128, None])
def test_rmsnorm_fp8_quantizes_the_fused_norms_output(group):
    from rxf.plugins.models.layers.norm import RMSNorm
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm_fp8

    norm = RMSNorm(4096, 1e-5, torch.bfloat16).to(CUDA)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(300, 4096, device=CUDA, dtype=torch.bfloat16)
    res = torch.randn(300, 4096, device=CUDA, dtype=torch.bfloat16)
    res_fused = res.clone()
    q, s = rmsnorm_fp8(x, norm.weight, norm.eps, res_fused, group, pad_rows=4, column_major=True)
    normed, res_ref = norm(x.clone(), res.clone())  # FlashInfer's fused add + norm, then the quantization
    assert torch.equal(res_fused, res_ref)
    ref_q, ref_s = per_token_group_quant(normed, group or 4096)
    assert torch.allclose(s[:300], ref_s, rtol=1e-2)
    # Codes dequantized: equal but where an rsqrt's last bit moved the bf16 output a step.
    deq = fp8_ops.dequantize_blocks(q[:300], s[:300], group or 4096, torch.float32)
    assert _rel(deq, fp8_ops.dequantize_blocks(ref_q, ref_s, group or 4096, torch.float32)) < 1e-2
