"""Quantized checkpoints on the CPU: each format's tiny Llama, written by `rxf.testing.quantized_checkpoints`
from the format's documentation, must give the logits (1e-4 of the largest) and greedy tokens of
transformers running its dequantized float32 twin. With `RXF_CPU_WEIGHT_PACKING=0` every method
dequantizes at load on the CPU, so rxf computes with exactly the twin's weights (the packed int4
path, bf16 activations, is tests/unit/test_cpu_weight_packing.py's)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rxf.core.hookspecs import hookimpl
from rxf.core.registry import PluginRegistry
from rxf.plugins.quantization.base import LinearMethod
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import check_logits
from rxf.testing.quantized_checkpoints import fp8_experts, quantize_checkpoint
from rxf.testing.reference import HFReference

PROMPTS = [[5, 80, 17, 300, 42, 9, 77, 123], [400, 12, 33, 7, 250]]
# hidden 128 and intermediate 256: whole groups of 128 inputs; k/v projections of 64 rows leave
# FP8 blocks of 128 rows partly filled inside the fused qkv layer.
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense"), seed=3, initializer_range=0.1, **SHAPE)


CASES = {
    "fp8-block": ("fp8", {}),
    "fp8-block-64": ("fp8", {"block": (64, 64)}),
    "ct-channel": ("ct-channel", {}),
    "ct-tensor-static": ("ct-tensor", {"static": True}),
    "awq-g128": ("awq", {"group_size": 128}),
    "awq-g32": ("awq", {"group_size": 32}),
    "gptq-sym": ("gptq", {"sym": True}),
    "gptq-sym-desc-act-g64": ("gptq", {"sym": True, "desc_act": True, "group_size": 64}),
    "gptq-asym-v2-desc-act": ("gptq", {"sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"}),
    "gptq-asym-g32": ("gptq", {"sym": False, "group_size": 32}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_checkpoint_matches_its_dequantized_twin(dense, tmp_path, monkeypatch, case):
    monkeypatch.setenv("RXF_CPU_WEIGHT_PACKING", "0")
    fmt, opts = CASES[case]
    quantized = quantize_checkpoint(dense, tmp_path / "q", fmt, twin=tmp_path / "twin", **opts)
    ref = HFReference(tmp_path / "twin")
    check_logits(quantized, PROMPTS, reference=ref, decode_steps=2)
    harness = ModelHarness(quantized)
    assert harness.greedy(PROMPTS[:1], 12) == [ref.greedy(PROMPTS[0], 12)]


def test_online_fp8_rounds_each_weight_row_through_fp8(dense, tmp_path):
    """`model.quantization = "fp8"` on an unquantized checkpoint: exactly the per-row FP8 weights
    (compressed-tensors' per-channel twin is the same rounding, written by the test's own code), and
    near the unquantized model: FP8 E4M3 keeps 3 mantissa bits, a relative rounding error of at most
    2^-4 per weight and about 2.6% of a Gaussian weight row's norm; the tiny model's 8 quantized
    matmuls in a row compound that to 9-10% of the logits' norm (measured), so 20% bounds it with
    room while a lost or misplaced weight (errors of order 100%) still fails."""
    quantize_checkpoint(dense, tmp_path / "q", "ct-channel", twin=tmp_path / "fp8-twin")
    check_logits(dense, PROMPTS[:1], reference=HFReference(tmp_path / "fp8-twin"), decode_steps=1,
                 **{"model.quantization": "fp8"})
    unquantized = HFReference(dense)
    harness = ModelHarness(dense, **{"model.quantization": "fp8"})
    for prompt, ours in zip(PROMPTS, harness.prefill_logits(PROMPTS), strict=True):
        ref = unquantized.logits(prompt)
        error = ((ours - ref).norm() / ref.norm()).item()
        assert 0 < error < 0.2, error


def _harness_error(path, **overrides) -> str:
    with pytest.raises((ValueError, NotImplementedError)) as info:
        ModelHarness(path, **overrides)
    return str(info.value)


def _rewrite(path, **quant_config_changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quant_config_changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_method_fails_naming_it_and_the_registered_ones(dense, tmp_path):
    message = _harness_error(dense, **{"model.quantization": "int3-magic"})
    assert "'int3-magic'" in message and "model.quantization" in message
    for name in ("awq", "compressed-tensors", "fp8", "gptq"):
        assert name in message
    q = quantize_checkpoint(dense, tmp_path / "q", "awq")
    _rewrite(q, quant_method="squeezellm")
    message = _harness_error(q)
    assert "quant_method 'squeezellm'" in message and "gptq" in message


def test_a_tensor_that_does_not_fit_the_layout_fails_naming_it(dense, tmp_path):
    q = quantize_checkpoint(dense, tmp_path / "q", "awq", group_size=128)
    _rewrite(q, group_size=64)  # scales and zeros now have half the groups the layers expect
    message = _harness_error(q)
    assert "model.layers.0.mlp.down_proj.qzeros" in message and "does not fit" in message
    tensors = load_file(str(q / "model.safetensors"))
    _rewrite(q, group_size=128)
    name = "model.layers.1.self_attn.o_proj.qweight"
    tensors[name] = tensors[name].to(torch.int16)
    save_file(tensors, str(q / "model.safetensors"))
    message = _harness_error(q)
    assert name in message and "dtype int16, expected int32" in message


def test_methods_refuse_what_they_cannot_read(dense, tmp_path):
    assert "cannot quantize at load" in _harness_error(dense, **{"model.quantization": "awq"})
    q = quantize_checkpoint(dense, tmp_path / "q", "gptq")
    assert "cannot read a checkpoint quantized with 'gptq'" in _harness_error(q, **{"model.quantization": "fp8"})
    _rewrite(q, bits=8)
    assert "bits = 8 is not supported" in _harness_error(q)
    ct = quantize_checkpoint(dense, tmp_path / "ct", "ct-channel")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    (ct / "config.json").write_text(json.dumps(config))
    assert "num_bits = 4 is not supported" in _harness_error(ct)


class _AliasPlugin:
    """A third-party plugin's hook: a method registered under a new name."""

    @hookimpl
    def rxf_register_quantization_methods(self, register):
        register("fp8-rows", "rxf.plugins.quantization.fp8:Fp8Method")


def test_a_plugin_registers_a_quantization_method(dense):
    registry = PluginRegistry.load()
    registry.register_plugin(_AliasPlugin(), "alias-plugin")
    assert {"fp8", "awq", "gptq", "compressed-tensors", "fp8-rows"} <= set(registry.names("quantization_methods"))
    harness = ModelHarness(dense, registry=registry, **{"model.quantization": "fp8-rows"})
    qkv = harness.runner.model.model.layers[0].self_attn.qkv_proj
    assert not torch.equal(qkv.weight, ModelHarness(dense).runner.model.model.layers[0].self_attn.qkv_proj.weight)


class _GatedInput(LinearMethod):
    """A method over dense weights that takes the MLP's activation and the pre-norms into its own input
    pass (as the FP8 methods do inside their activation quantization on CUDA), counting the layers
    that hand them over."""

    name = "gated-input"
    gated_calls: list[str] = []
    normed_calls: list[str] = []

    def __init__(self, quant_config, dtype):
        super().__init__(None, dtype)

    def create_weights(self, layer):
        layer.create_dense_weight()

    def apply(self, layer, x, bias):
        return torch.nn.functional.linear(x, layer.weight, bias)

    def apply_gated(self, layer, x, act, bias):
        self.gated_calls.append(type(act).__name__)
        return torch.nn.functional.linear(act(x), layer.weight, bias)

    def apply_normed(self, layer, h, residual, norm, bias):
        self.normed_calls.append(layer.gemv_role)
        normed, residual = norm(h, residual)
        return torch.nn.functional.linear(normed, layer.weight, bias), residual


class _GatedInputPlugin:
    @hookimpl
    def rxf_register_quantization_methods(self, register):
        register("gated-input", _GatedInput)


def test_layers_hand_their_activation_and_norms_to_the_projections_method(dense):
    registry = PluginRegistry.load()
    registry.register_plugin(_GatedInputPlugin(), "gated-input-plugin")
    _GatedInput.gated_calls.clear()
    _GatedInput.normed_calls.clear()
    harness = ModelHarness(dense, registry=registry, **{"model.quantization": "gated-input"})
    prompt = [[5, 9, 13, 2, 7]]
    logits = harness.prefill_logits(prompt)[0]
    layers = harness.runner.model.config.num_hidden_layers
    assert _GatedInput.gated_calls == ["SiluAndMul"] * layers  # one down projection a layer
    # Both pre-norms of every layer, but the first layer's input norm (no residual stream yet).
    assert _GatedInput.normed_calls == ["gate_up_proj"] + ["qkv_proj", "gate_up_proj"] * (layers - 1)
    torch.testing.assert_close(logits, ModelHarness(dense).prefill_logits(prompt)[0], rtol=0, atol=0)


class _Activated(_GatedInput):
    """The same, except that gate/up leaves its norm to the layer and takes the activation after it
    into its own pass instead (as the int4 decode GEMV does at batch 1, `QuantGemv.activated`)."""

    name = "activated"
    activated_calls: list[str] = []

    def apply_normed(self, layer, h, residual, norm, bias):
        return None if layer.gemv_role == "gate_up_proj" else super().apply_normed(layer, h, residual, norm, bias)

    def apply_activated(self, layer, x, act, bias):
        self.activated_calls.append(layer.gemv_role)
        return act(torch.nn.functional.linear(x, layer.weight, bias))


def test_gate_up_hands_its_activation_to_its_method(dense):
    registry = PluginRegistry.load()
    registry.register_plugin(_ActivatedPlugin(), "activated-plugin")
    for calls in (_Activated.gated_calls, _Activated.normed_calls, _Activated.activated_calls):
        calls.clear()
    harness = ModelHarness(dense, registry=registry, **{"model.quantization": "activated"})
    prompt = [[5, 9, 13, 2, 7]]
    logits = harness.prefill_logits(prompt)[0]
    layers = harness.runner.model.config.num_hidden_layers
    # Every MLP's gate/up takes its SiLU·mul; the down projection then reads the activation as it is.
    assert _Activated.activated_calls == ["gate_up_proj"] * layers
    assert _Activated.gated_calls == [] and _Activated.normed_calls == ["qkv_proj"] * (layers - 1)
    torch.testing.assert_close(logits, ModelHarness(dense).prefill_logits(prompt)[0], rtol=0, atol=0)


class _ActivatedPlugin:
    @hookimpl
    def rxf_register_quantization_methods(self, register):
        register("activated", _Activated)


# Qwen3-MoE: 4 experts of width 64 (gate and up of 64 rows fill half a 128-row FP8 block each) with
# top 2, a dense layer (mlp_only_layers) beside a sparse one. Mixtral: its `w1/w2/w3` names.
QWEN3_MOE = {**SHAPE, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
             "norm_topk_prob": True, "mlp_only_layers": [0]}
MIXTRAL = {**SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2}
MOE_CASES = {
    "qwen3-moe-fp8-block": ("Qwen3MoeForCausalLM", QWEN3_MOE, "fp8", {}),
    "qwen3-moe-ct-channel": ("Qwen3MoeForCausalLM", QWEN3_MOE, "ct-channel", {}),
    "mixtral-fp8-block-64": ("MixtralForCausalLM", MIXTRAL, "fp8", {"block": (64, 64)}),
    "mixtral-ct-tensor-static": ("MixtralForCausalLM", MIXTRAL, "ct-tensor", {"static": True}),
}


@pytest.fixture(scope="module")
def moe_dense(tmp_path_factory):
    """The dense MoE checkpoints, one per architecture."""
    made = {}
    for arch, shape in (("Qwen3MoeForCausalLM", QWEN3_MOE), ("MixtralForCausalLM", MIXTRAL)):
        made[arch] = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=5, initializer_range=0.1, **shape)
    return made


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_quantized_moe_checkpoint_matches_its_dequantized_twin(moe_dense, tmp_path, case):
    """Experts and dense layers quantized (routers left dense, as quantizers leave them): logits and
    greedy tokens of transformers running the float32 twin."""
    arch, _, fmt, opts = MOE_CASES[case]
    quantized = quantize_checkpoint(moe_dense[arch], tmp_path / "q", fmt, twin=tmp_path / "twin", **opts)
    names = load_file(str(quantized / "model.safetensors"))
    expert = next(n for n in names if ".experts.1." in n and n.endswith(".weight"))
    assert names[expert].dtype == torch.float8_e4m3fn, expert
    ref = HFReference(tmp_path / "twin")
    check_logits(quantized, PROMPTS, reference=ref, decode_steps=1)
    assert ModelHarness(quantized).greedy(PROMPTS[:1], 12) == [ref.greedy(PROMPTS[0], 12)]


def test_online_fp8_quantizes_the_experts_too(moe_dense, tmp_path):
    """`model.quantization = "fp8"` on a dense MoE checkpoint rounds each expert's rows through FP8
    like the dense layers' (the per-channel twin, with the router left dense, is the same rounding)."""
    dense = moe_dense["Qwen3MoeForCausalLM"]
    quantize_checkpoint(dense, tmp_path / "q", "ct-channel", twin=tmp_path / "fp8-twin")
    check_logits(dense, PROMPTS[:1], reference=HFReference(tmp_path / "fp8-twin"), decode_steps=1,
                 **{"model.quantization": "fp8"})


def test_quantized_experts_bad_input_and_int4_refusal(moe_dense, tmp_path):
    """An expert tensor of the wrong dtype or shape fails naming it; int4 experts are refused at
    load naming the method."""
    q = quantize_checkpoint(moe_dense["Qwen3MoeForCausalLM"], tmp_path / "fp8", "fp8")
    tensors = load_file(str(q / "model.safetensors"))
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    good = tensors[name]
    tensors[name] = good[:, :0]
    save_file(tensors, str(q / "model.safetensors"))
    message = _harness_error(q)
    assert name in message and "does not fit" in message
    tensors[name] = good.to(torch.int32)
    save_file(tensors, str(q / "model.safetensors"))
    message = _harness_error(q)
    assert name in message and "dtype int32, expected float32" in message
    mixtral = moe_dense["MixtralForCausalLM"]
    awq = quantize_checkpoint(mixtral, tmp_path / "awq", "awq")
    _rewrite(awq, modules_to_not_convert=["gate"])  # the router, as AWQ's Mixtral checkpoints list it
    assert _harness_error(awq).startswith("awq: quantized MoE experts (model.layers.0.mlp.experts)")


def test_random_weights_quantized_at_load(moe_dense, tmp_path):
    """`model.load_format = "random"` with online FP8 (the benchmarks' checkpoints too large for the
    disk): the random draws, experts included, rounded per row through FP8; a quantized checkpoint
    cannot take random weights."""
    dense = moe_dense["Qwen3MoeForCausalLM"]
    drawn = ModelHarness(dense, **{"model.load_format": "random"}).runner.model.model.layers[1].mlp.experts
    online = ModelHarness(dense, **{"model.load_format": "random", "model.quantization": "fp8"})
    experts = online.runner.model.model.layers[1].mlp.experts
    for ours, theirs in ((experts.w13.weight, drawn.w13.weight), (experts.w2.weight, drawn.w2.weight)):
        assert torch.equal(ours, fp8_experts(theirs, None)[2])
    q = quantize_checkpoint(dense, tmp_path / "q", "fp8")
    assert "cannot serve a quantized checkpoint" in _harness_error(q, **{"model.load_format": "random"})
