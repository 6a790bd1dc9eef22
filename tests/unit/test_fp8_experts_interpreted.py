"""The path CUDA takes for FP8 experts — kept in FP8 at load, their forward through the fused MoE
kernels' scaled FP8 loads — run on the CPU under the Triton interpreter in float32 (`keeps_fp8`
answers yes for the CPU). FP8 values are exact in float32 and the scales multiply in float32, so
the logits match transformers on the float32 twin to 1e-4; prefill takes the grouped kernels,
decode the GEMV-shaped ones. The dense FP8 layers dequantize at load as on any CPU run.

As in test_fused_moe.py, TRITON_INTERPRET is set before triton is imported, and the module is
skipped where CUDA is present (tests/gpu/test_moe_fp8_gpu.py runs this path compiled).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_moe_fp8_gpu.py runs this path compiled", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.quantization import fp8_experts  # noqa: E402
from rxf.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from rxf.testing.model_parity import check_logits  # noqa: E402
from rxf.testing.quantized_checkpoints import quantize_checkpoint  # noqa: E402
from rxf.testing.reference import HFReference  # noqa: E402


@pytest.mark.parametrize(("fmt", "opts"), [("fp8", {"block": (64, 64)}), ("ct-channel", {})])
def test_the_kernel_path_matches_the_twin(tmp_path, monkeypatch, fmt, opts):
    monkeypatch.setattr(fp8_experts, "keeps_fp8", lambda weight: True)
    dense = make_tiny_checkpoint(tmp_path / "dense", "Qwen3MoeForCausalLM", seed=5, initializer_range=0.1,
                                 hidden_size=128, intermediate_size=256, head_dim=32, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0])
    quantized = quantize_checkpoint(dense, tmp_path / "q", fmt, twin=tmp_path / "twin", **opts)
    calls = []
    apply = fp8_experts.apply
    monkeypatch.setattr(fp8_experts, "apply", lambda *args: calls.append(1) or apply(*args))
    check_logits(quantized, [[5, 80, 17, 300, 42, 9, 77, 123], [400, 12, 33]],
                 reference=HFReference(tmp_path / "twin"), decode_steps=1)
    assert calls, "the experts did not run their FP8 path"
