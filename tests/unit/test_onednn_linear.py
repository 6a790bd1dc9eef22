"""Dense CPU linears packed for oneDNN after loading (`rxf/plugins/models/layers/onednn_linear.py`):
the packed matmul against F.linear on the plain weight, and a tiny model with packing on and off
(`RXF_CPU_WEIGHT_PACKING`), whose logits and greedy tokens must agree; the model-parity tests against
transformers run with packing on (the default)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rxf.plugins.models.layers import MergedColumnParallelLinear, RowParallelLinear, onednn_linear
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness

if not onednn_linear.packs(torch.empty(2, 2)):
    pytest.skip("this torch has no oneDNN linear packing", allow_module_level=True)
BF16 = onednn_linear.packs(torch.empty(2, 2, dtype=torch.bfloat16))
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16, reason="no native bf16"))]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    for layer in (MergedColumnParallelLinear(96, [80, 80], bias=True, dtype=dtype), RowParallelLinear(160, 96, dtype=dtype)):
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen).to(dtype)
        if layer.bias is not None:
            layer.bias.data = torch.randn(layer.bias.shape, generator=gen).to(dtype)
        plain = layer.weight.data.clone()
        x = torch.randn(rows, plain.shape[1], generator=gen).to(dtype)
        want = F.linear(x, plain, layer.bias)
        layer.loaded()
        assert layer.weight.is_mkldnn and torch.equal(layer.weight.to_dense(), plain)
        with torch.inference_mode():
            got = layer(x)
        # bf16: both round one float32 sum per output (a summation order apart: one bf16 step)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_a_model_packed_and_plain_agree(tmp_path, monkeypatch) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "llama", seed=3, tie_word_embeddings=True)
    prompts = [[5, 80, 17, 300, 42, 9, 77, 123], [400, 12, 33, 7, 250]]
    packed = ModelHarness(ckpt)
    model = packed.runner.model
    assert model.model.layers[0].mlp.down_proj.weight.is_mkldnn and model.lm_head.packed is not None
    assert not model.model.embed_tokens.weight.is_mkldnn, "the tied embedding keeps its plain weight"
    monkeypatch.setenv(onednn_linear.ENV, "0")
    plain = ModelHarness(ckpt)
    assert not plain.runner.model.model.layers[0].mlp.down_proj.weight.is_mkldnn
    for a, b in zip(packed.prefill_logits(prompts), plain.prefill_logits(prompts), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert packed.greedy(prompts, 12) == plain.greedy(prompts, 12)
