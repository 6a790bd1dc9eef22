"""The CPU's packed int4 / int8 weights (`rxf.plugins.quantization.cpu_packing`).

Layer level: the packed matmul against the dequantized weight computed here, with the op's own
roundings reproduced (bf16 activations, bf16 scales and zeros, a float32 sum rounded to a bf16
output): for a few rows (decode) that reproduces it exactly (measured: 0 difference), so the test
allows one bf16 step (2^-8 relative). Larger batches take another path inside torch (measured
1.5e-3 of the largest output from that emulation); there the test bounds the error against the
exact float32 product at 1e-2 of its norm. Model level: a tiny checkpoint against transformers on
its dequantized float32 twin, where the bf16 roundings are the difference: measured 0.9-1.2% of the
logits' norm on these 2-layer models (each of 4 matmuls per layer rounds its input and the weights'
scales by up to 2^-9, and the model's random weights amplify it), so 3% bounds it while a misplaced
group or zero (errors of order 100%) fails. Greedy tokens of a random tiny model sit too close
together to survive that (its top logits differ by less than 1%); tests/integration/test_demo_q4.py
checks greedy tokens on the real demo model.
"""

from __future__ import annotations

import pytest
import torch

from rxf.plugins.quantization import cpu_packing
from rxf.plugins.quantization.online_int import quantize_int8_rows
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.quantized_checkpoints import quantize_checkpoint
from rxf.testing.reference import HFReference

PROMPTS = [[5, 80, 17, 300, 42, 9, 77, 123], [400, 12, 33, 7, 250]]
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
MODEL_TOLERANCE = 0.03  # of the logits' norm: see the module docstring

pytestmark = pytest.mark.skipif(not cpu_packing.enabled(), reason="torch lacks the packed int4 / int8 CPU ops")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _assert_matmul_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """One bf16 rounding step apart at most (the op's output is bf16)."""
    torch.testing.assert_close(out, ref, rtol=2**-8, atol=1e-5 * ref.abs().max().item())


def _assert_near_exact(out: torch.Tensor, exact: torch.Tensor) -> None:
    assert ((out - exact).norm() / exact.norm()).item() < 1e-2


@pytest.mark.parametrize(("n", "k", "group", "kernel_group"), [(96, 256, 32, 32), (48, 256, 128, 128),
                                                                (32, 192, 96, 32), (16, 512, 256, 256)])
def test_int4_matmul_is_the_dequantized_weight_of_q_minus_z_times_s(n, k, group, kernel_group):
    gen = torch.Generator().manual_seed(n + group)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    assert cpu_packing.int4_kernel_group(n, k, group) == kernel_group
    packed = cpu_packing.pack_codes(codes)
    scales_and_zeros = cpu_packing.int4_scales_and_zeros(scales, zeros, group, kernel_group)
    x = torch.randn(5, k, generator=gen)
    out = cpu_packing.int4_linear(x, packed, kernel_group, scales_and_zeros, None)
    s = _bf16(scales.float()).repeat_interleave(group, 0)
    zero = _bf16((8 - zeros) * scales.float()).repeat_interleave(group, 0)
    w = (codes.float().t() - 8) * s + zero  # [K, N], the op's convention with the bf16 roundings
    assert out.dtype == torch.float32 and out.shape == (5, n)
    _assert_matmul_close(out, _bf16(_bf16(x) @ w))
    exact = (codes.float().t() - zeros.repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)
    prefill = torch.randn(2, 20, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = cpu_packing.int4_linear(prefill, packed, kernel_group, scales_and_zeros, bias)
    assert out.shape == (2, 20, n)
    _assert_near_exact(out - bias, prefill @ exact)
    # Larger batches where oneDNN has no bf16 kernels: the same weight, dequantized from two codes a byte.
    nibbles = cpu_packing.pack_nibbles(codes)
    assert nibbles.shape == (n, k // 2) and torch.equal(nibbles & 15, codes[:, : k // 2])
    torch.testing.assert_close(cpu_packing.dequantize_nibbles(nibbles, scales_and_zeros, kernel_group), w.t())


def test_int8_matmul_is_q_times_the_row_scale():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(100, 64, generator=gen) * 0.05  # 100 rows: the int8 op takes any N
    q, scale = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    dequantized = q.float() * scale.float()[:, None]
    assert ((dequantized - w).abs() <= scale.float()[:, None] / 2 + 1e-7).all()  # half a step per weight
    x = torch.randn(5, 64, generator=gen)
    _assert_matmul_close(cpu_packing.int8_linear(x, q, scale, None), _bf16(_bf16(x) @ dequantized.t()))
    prefill = torch.randn(3, 7, 64, generator=gen)
    _assert_near_exact(cpu_packing.int8_linear(prefill, q, scale, None), prefill @ dequantized.t())


def test_int4_shapes_the_op_cannot_take_are_not_packed(monkeypatch):
    assert cpu_packing.int4_kernel_group(100, 256, 32) is None  # outputs not a multiple of 16
    assert cpu_packing.int4_kernel_group(96, 256, 16) is None  # groups below the op's 32
    assert cpu_packing.int4_kernel_group(96, 200, 40) is None
    assert cpu_packing.int8_fits(72) is False  # torch's int8 kernel needs K % 16 for batches > 1
    monkeypatch.setenv(cpu_packing.ENV, "0")
    assert cpu_packing.int4_kernel_group(96, 256, 32) is None and not cpu_packing.int8_fits(256)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), seed=3, initializer_range=0.1, **SHAPE)


def _relative_errors(harness: ModelHarness, reference: HFReference) -> list[float]:
    errors = []
    for prompt, ours in zip(PROMPTS, harness.prefill_logits(PROMPTS), strict=True):
        ref = reference.logits(prompt)
        errors.append(((ours - ref).norm() / ref.norm()).item())
    return errors


@pytest.mark.parametrize(("fmt", "opts"), [("awq", {"group_size": 32}),
                                           ("gptq", {"sym": False, "desc_act": True, "group_size": 64})])
def test_int4_checkpoints_run_packed_near_their_dequantized_twin(dense, tmp_path, fmt, opts):
    quantized = quantize_checkpoint(dense, tmp_path / "q", fmt, twin=tmp_path / "twin", **opts)
    harness = ModelHarness(quantized)
    layer = harness.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.qweight.dtype == torch.uint8 and layer.scales_and_zeros.dtype == torch.bfloat16
    assert (layer.input_order is not None) == opts.get("desc_act", False)  # act order permutes inputs
    errors = _relative_errors(harness, HFReference(tmp_path / "twin"))
    assert all(0 < e < MODEL_TOLERANCE for e in errors), errors


# Online: the dequantized path (packing off) holds exactly the weights the packed path multiplies by
# (`online_int.py`), so each weight is checked against the unquantized one (at most half a step of
# its row's or group's scale off), the packed logits against the dequantized path's (the bf16
# roundings and the int8 logits head, which the dequantized path leaves dense: measured 1.1-1.2%,
# bound 3% as above), and the logits against the unquantized model's: per-weight errors of
# about 0.7% (int8: a step of absmax / 127) and 8% (int4: a step of a 32-weight group's range / 15)
# of a Gaussian row's scale compound over the tiny model's 8 matmuls to 2.7% and 33-38% of the
# logits' norm (measured, as online FP8's 2.6% gives 9-10%); the bounds leave twice that.
ONLINE = {"int8": 0.06, "int4": 0.7, "int4-g128": 0.8}


@pytest.mark.parametrize("method", sorted(ONLINE))
def test_online_integer_quantization(dense, monkeypatch, method):
    packed = ModelHarness(dense, **{"model.quantization": method})
    down = packed.runner.model.model.layers[0].mlp.down_proj
    assert hasattr(down, "weight_int8" if method == "int8" else "scales_and_zeros") and not hasattr(down, "weight")
    assert packed.runner.model.lm_head.weight_int8.dtype == torch.int8  # the head, int8 per row
    monkeypatch.setenv(cpu_packing.ENV, "0")
    reference = ModelHarness(dense, **{"model.quantization": method})
    unquantized = ModelHarness(dense)
    for name, param in reference.runner.model.named_parameters():
        original = dict(unquantized.runner.model.named_parameters())[name]
        if name.endswith("proj.weight"):
            error = (param - original).abs()
            if method == "int8":
                step = original.abs().amax(dim=1, keepdim=True) / 127
            else:
                group = 32 if method == "int4" else 128
                grouped = original.reshape(original.shape[0], -1, group)
                step = ((grouped.amax(-1) - grouped.amin(-1)) / 15).repeat_interleave(group, 1)
            # Half a step, plus bf16's rounding of the scale (and offset) the codes were chosen for.
            assert (error <= step * (0.5 + 2**-7) + original.abs() * 2**-7).all(), name
        else:
            assert torch.equal(param, original), name
    hf = HFReference(dense)
    for ours, theirs, prompt in zip(packed.prefill_logits(PROMPTS), reference.prefill_logits(PROMPTS), PROMPTS, strict=True):
        assert ((ours - theirs).norm() / theirs.norm()).item() < MODEL_TOLERANCE
        ref = hf.logits(prompt)
        assert 0 < ((theirs - ref).norm() / ref.norm()).item() < ONLINE[method]


def test_int8_logits_head_rescores_its_top_logits_densely(dense):
    """The head's int8 logits come out of the op in bf16; the 16 highest of each row are the dense
    head's (so greedy choices between near-ties are the dense model's), the rest an int8 estimate."""
    head = ModelHarness(dense, **{"model.quantization": "int8"}).runner.model.lm_head
    hidden = torch.randn(3, head.weight.shape[1], generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ours, exact = head(hidden), hidden @ head.weight.t()
        estimate = cpu_packing.int8_linear(hidden, head.weight_int8, head.weight_scale, None)
    top = estimate.topk(16, dim=-1).indices
    torch.testing.assert_close(ours.gather(-1, top), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    assert ((ours - exact).norm() / exact.norm()).item() < 0.02  # int8 rows: half a step of absmax / 127


def test_online_integer_methods_refuse_what_they_cannot_serve(dense, tmp_path):
    odd = make_tiny_checkpoint(tmp_path / "odd", hidden_size=192, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"'int4-g128': model\.layers\.0\.self_attn\.qkv_proj has 192 inputs, not a "
                                         r"multiple of the group size 128"):
        ModelHarness(odd, **{"model.quantization": "int4-g128"})
    awq = quantize_checkpoint(dense, tmp_path / "awq", "awq")
    with pytest.raises(ValueError, match="'int8' quantizes an unquantized checkpoint at load; this checkpoint is "
                                         "quantized with 'awq'"):
        ModelHarness(awq, **{"model.quantization": "int8"})


def test_online_integer_methods_keep_moe_experts_dense(tmp_path):
    mixtral = make_tiny_checkpoint(tmp_path / "mixtral", "MixtralForCausalLM", num_local_experts=4,
                                   num_experts_per_tok=2, initializer_range=0.1, **SHAPE)
    layer = ModelHarness(mixtral, **{"model.quantization": "int4"}).runner.model.model.layers[0]
    dense = ModelHarness(mixtral).runner.model.model.layers[0]
    assert torch.equal(layer.mlp.experts.w13.weight, dense.mlp.experts.w13.weight)
    assert hasattr(layer.self_attn.qkv_proj, "scales_and_zeros")


@pytest.mark.skipif(not cpu_packing.dense_packable(torch.empty(1, 1, dtype=torch.bfloat16)),
                    reason="no oneDNN bf16 kernels (or packing off)")
def test_dense_bf16_matmul_on_the_packed_weight_is_f_linear_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    for n, k in ((96, 64), (576, 1536)):
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16()
        packed = cpu_packing.pack_dense(w)
        for x in (torch.randn(1, k, generator=gen), torch.randn(33, k, generator=gen),
                  torch.randn(2, 7, k, generator=gen), torch.randn(5, 2 * k, generator=gen)[:, ::2]):
            x = x.bfloat16()
            assert torch.equal(cpu_packing.dense_linear(x, packed, None, bias), torch.nn.functional.linear(x, w, bias))
            assert torch.equal(cpu_packing.dense_linear(x, packed, None, None), torch.nn.functional.linear(x, w))


@pytest.mark.skipif(not (cpu_packing.dense_packable(torch.empty(1, 1, dtype=torch.bfloat16))
                         and cpu_packing.keeps_plain_weight()), reason="no AVX512-BF16 (or the op cannot be built)")
@pytest.mark.parametrize(("n", "k"), [(96, 64), (577, 1536), (130, 70), (49152, 576)])
def test_few_rows_read_the_plain_weight_within_one_rounding_of_the_exact_product(n, k):
    """Up to 4 rows: the dot kernel over `plain`, within one bf16 rounding of the float32 product
    (K off the kernel's 32-input chunks, N off its 64-row blocks, bias, 3-D and strided x); 5 rows
    and more: oneDNN on the packed copy. `plain` is given as 2 W here, so each path shows which
    weight it read."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = cpu_packing.pack_dense(w)
    for x in (torch.randn(1, k, generator=gen), torch.randn(3, k, generator=gen), torch.randn(2, 2, k, generator=gen),
              torch.randn(4, 2 * k, generator=gen)[:, ::2], torch.randn(5, k, generator=gen)):
        x = x.bfloat16()
        out = cpu_packing.dense_linear(x, packed, 2 * w, bias)
        if x.numel() // k <= 4:
            exact = x.float() @ (2 * w).float().t() + bias.float()
            torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=2**-8 * exact.abs().max().item())
        else:
            assert torch.equal(out, torch.nn.functional.linear(x, w, bias))
    x = torch.randn(2, k, generator=gen).bfloat16()
    ref = torch.nn.functional.linear(x, w).float()  # one rounding apart at most: the sums' order differs
    torch.testing.assert_close(cpu_packing.dense_linear(x, packed, w, None).float(), ref, rtol=2**-7,
                               atol=2**-8 * ref.abs().max().item())


@pytest.mark.skipif(not cpu_packing.dense_packable(torch.empty(1, 1, dtype=torch.bfloat16)),
                    reason="no oneDNN bf16 kernels (or packing off)")
def test_a_bf16_model_runs_its_dense_layers_on_packed_weights(dense, monkeypatch):
    """Every projection and the head of a bf16 model compute from oneDNN's packed copy (the dense
    Parameter keeps only its shape and dtype, unless the few-row kernel reads it); logits (a
    prefill: oneDNN) are F.linear's exactly, and greedy tokens (decode steps of 2 rows, through the
    few-row kernel where it runs) are F.linear's. float32 stays on F.linear (the tests' exactness
    reference)."""
    bf16 = {"model.dtype": "bfloat16"}
    packed = ModelHarness(dense, **bf16)
    model = packed.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_weight is not None and qkv.weight.dtype == torch.bfloat16
    assert qkv.weight.is_meta != cpu_packing.keeps_plain_weight()
    assert (qkv.plain_weight is not None) == (model.lm_head.plain_weight is not None) == cpu_packing.keeps_plain_weight()
    assert model.lm_head.packed_weight is not None and not model.lm_head.weight.is_meta  # the embedding may share it
    assert ModelHarness(dense).runner.model.lm_head.packed_weight is None
    monkeypatch.setenv(cpu_packing.ENV, "0")
    plain = ModelHarness(dense, **bf16)
    assert plain.runner.model.model.layers[0].self_attn.qkv_proj.packed_weight is None
    for ours, theirs in zip(packed.prefill_logits(PROMPTS), plain.prefill_logits(PROMPTS), strict=True):
        assert torch.equal(ours, theirs)
    assert packed.greedy(PROMPTS, 8) == plain.greedy(PROMPTS, 8)


def test_without_onednn_bf16_large_batches_compute_in_float32(dense, monkeypatch):
    """Where oneDNN has no bf16 kernels (AVX2 alone: forced here on any CPU), a bf16 layer computes
    batches of `UPCAST_MIN_ROWS` rows and more in float32 (the head from `HEAD_UPCAST_MIN_ROWS`), and
    smaller ones on F.linear: a 71-token prefill upcasts every projection and the head, a 13-token
    prefill and 2-row decode steps none. Both paths sum in float32 and round their outputs to bf16,
    so the logits are the all-F.linear model's up to the order of those sums (measured 0.17% of the
    logits' norm here, against 1.7-1.9% between either and the float32 reference: bf16 rounds the
    weights, activations and K/V of both alike). Bounds: 1%, and `MODEL_TOLERANCE`."""
    monkeypatch.setattr(cpu_packing, "onednn_bf16", lambda: False)
    rows = []
    upcast = cpu_packing.upcast_linear
    monkeypatch.setattr(cpu_packing, "upcast_linear",
                        lambda x, *a, **kw: rows.append(x.numel() // x.shape[-1]) or upcast(x, *a, **kw))
    bf16 = {"model.dtype": "bfloat16"}
    ours = ModelHarness(dense, **bf16)
    model = ours.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed_weight is None and qkv.upcast_min_rows == cpu_packing.UPCAST_MIN_ROWS
    assert model.lm_head.upcast_min_rows == cpu_packing.HEAD_UPCAST_MIN_ROWS
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (41, 30)]
    logits = ours.prefill_logits(prompts)
    assert rows and min(rows) == 71 and rows.count(71) == 4 * 2 + 1  # 4 projections x 2 layers, the head
    rows.clear()
    ours.greedy(PROMPTS, 3)
    assert rows == []
    monkeypatch.setenv(cpu_packing.ENV, "0")
    plain = ModelHarness(dense, **bf16)
    assert plain.runner.model.model.layers[0].self_attn.qkv_proj.upcast_min_rows is None
    reference = HFReference(dense)
    for prompt, up, lin in zip(prompts, logits, plain.prefill_logits(prompts), strict=True):
        ref = reference.logits(prompt)
        assert ((up - lin).norm() / lin.norm()).item() < 1e-2
        assert ((up - ref).norm() / ref.norm()).item() < MODEL_TOLERANCE


def test_without_onednn_bf16_experts_compute_their_larger_batches_in_float32(monkeypatch):
    """The MoE torch path (`experts_native`) upcasts as the dense layers do: an expert's rows in float32
    from `UPCAST_MIN_ROWS` on, fewer on F.linear. Both sum in float32 and round to bf16 (measured
    0.4% of the output's norm from the float32 reference, alike); bound 1%."""
    from rxf.plugins.models.layers.moe import experts_native

    monkeypatch.setattr(cpu_packing, "onednn_bf16", lambda: False)
    rows = []
    upcast = cpu_packing.upcast_linear
    monkeypatch.setattr(cpu_packing, "upcast_linear",
                        lambda x, *a, **kw: rows.append(x.shape[0]) or upcast(x, *a, **kw))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=gen).bfloat16()
    w13 = (torch.randn(4, 96, 64, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(4, 64, 48, generator=gen) * 0.1).bfloat16()
    # Experts 0 and 1 get 34 tokens each, 2 and 3 six (fewer than 16).
    ids = torch.tensor([[0, 1]] * 34 + [[2, 3]] * 6)
    weights = torch.full((40, 2), 0.5)
    ours = experts_native(x, w13, w2, weights, ids)
    assert rows == [34, 34, 34, 34]  # gate/up and down of experts 0 and 1
    monkeypatch.setenv(cpu_packing.ENV, "0")
    plain = experts_native(x, w13, w2, weights, ids)
    ref = experts_native(x.float(), w13.float(), w2.float(), weights, ids)
    assert ((ours.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((ours.float() - plain.float()).norm() / plain.float().norm()).item() < 1e-2


def test_without_onednn_bf16_int4_layers_dequantize_their_larger_batches(dense, tmp_path, monkeypatch):
    """Where oneDNN has no bf16 kernels (forced here), torch's int4 op is slower than a float32 matmul
    from a few dozen rows on, so an int4 layer keeps its codes two to a byte as well and multiplies
    batches of `INT4_DEQUANT_MIN_ROWS` rows or more by their float32 dequantization: a 71-token
    prefill does so in every projection, decode steps never. The weights are the op's (its bf16
    scales and zeros: 0.7% of the logits' norm from the dequantized fp32 twin, measured); the op
    also rounds the activations to bf16 (1.3%), the float32 matmul does not, so it is the nearer of
    the two to the twin; the paths 1.0% apart (bound 2%)."""
    monkeypatch.setattr(cpu_packing, "onednn_bf16", lambda: False)
    rows = []
    dequantize = cpu_packing.dequantize_nibbles
    monkeypatch.setattr(cpu_packing, "dequantize_nibbles", lambda *a: rows.append(a[0].shape) or dequantize(*a))
    quantized = quantize_checkpoint(dense, tmp_path / "q", "awq", twin=tmp_path / "twin", group_size=32)
    harness = ModelHarness(quantized)
    qkv = harness.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int4_nibbles.shape == (qkv.out_per_rank, qkv.in_per_rank // 2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=gen).tolist() for n in (41, 30)]
    logits = harness.prefill_logits(prompts)
    assert len(rows) == 4 * 2  # 4 projections x 2 layers
    rows.clear()
    harness.greedy(PROMPTS, 3)
    assert rows == []
    monkeypatch.setattr(cpu_packing, "INT4_DEQUANT_MIN_ROWS", 10**9)  # the op at every batch size
    reference = HFReference(tmp_path / "twin")
    for prompt, ours, op in zip(prompts, logits, harness.prefill_logits(prompts), strict=True):
        ref = reference.logits(prompt)
        ours_error, op_error = ((ours - ref).norm() / ref.norm()).item(), ((op - ref).norm() / ref.norm()).item()
        assert ours_error < op_error < MODEL_TOLERANCE
        assert ((ours - op).norm() / op.norm()).item() < 2e-2
    assert rows == []
