"""gpt-oss against transformers on tiny random checkpoints (CPU, fp32, torch_native): the MoE block
(router bias, softmax over the top k, clamped SwiGLU with biases, interleaved gate/up), logits
through ModelRunner and greedy tokens through Runtime (`rxf.testing.model_parity`: windows of 16 on
alternating layers, sinks, biases, yarn past the original window, prompts of 40-120 tokens,
chunked prefill at 8), the MXFP4 dequantizer against transformers' own, and a checkpoint whose
experts are stored as MXFP4 blocks/scales split over two files.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from rxf.plugins.models.gpt_oss import GptOssMoE, split_expert_tensors
from rxf.plugins.models.layers.moe import FusedExperts, GatedActivation, select_experts
from rxf.plugins.models.layers.mxfp4 import dequantize_mxfp4
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_parity import check_logits, check_runtime_greedy
from rxf.testing.reference import HFReference

# The quirks of gpt-oss in a tiny config: head_dim 24 != 64 / 4 heads, GQA, a window of 16 on the
# even layers and full attention on the odd ones, 4 experts / top 2, yarn whose original window (32)
# the prompts pass; sinks and all biases come random from the checkpoint builder.
TINY = {
    "num_hidden_layers": 2,
    "head_dim": 24,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
}
_rng = random.Random(18)
PROMPTS = [[_rng.randrange(5, 512) for _ in range(n)] for n in (40, 77, 120)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpt-oss"), "GptOssForCausalLM", seed=5, **TINY)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> HFReference:
    return HFReference(checkpoint)


def test_logits_match_transformers(checkpoint: Path, reference: HFReference) -> None:
    check_logits(checkpoint, PROMPTS, reference=reference)


def test_runtime_greedy_matches_transformers(checkpoint: Path, reference: HFReference) -> None:
    check_runtime_greedy(checkpoint, PROMPTS, chunk=8, new_tokens=24, reference=reference)


# ---------------------------------------------------------------- the MoE block
GPT_OSS = GatedActivation(alpha=1.702, limit=7.0, up_offset=1.0)


def load_experts(experts: FusedExperts, stacked: dict[str, torch.Tensor]) -> None:
    """Checkpoint tensors `x.mlp.experts.*` (transformers' stacked layout) into `experts`, through
    the model's own splitting into per-expert tensors and the experts' loaders."""
    shards = {"gate": (experts.w13, 0), "up": (experts.w13, 1), "down": (experts.w2, 0)}
    for name, tensor in split_expert_tensors(stacked.items(), torch.float32, torch.device("cpu")):
        e, proj, what = name.split(".")[-3:]
        module, j = shards[proj]
        param = getattr(module, what)
        param.weight_loader(param, tensor, (int(e), j))


def test_moe_block_matches_transformers() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=5, num_experts_per_tok=3,
                          num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    torch.manual_seed(0)
    ref = GptOssMLP(config).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.6)  # pre-activations of several units: the clamp at 7 bites
    ours = GptOssMoE(config, torch.float32)
    assert ours.experts.activation == GPT_OSS
    state = {n: t.detach() for n, t in ref.state_dict().items()}
    ours.router.weight.data.copy_(state["router.weight"])
    ours.router.bias.data.copy_(state["router.bias"])
    load_experts(ours.experts, {f"x.mlp.{n}": t for n, t in state.items() if n.startswith("experts.")})
    x = torch.randn(41, config.hidden_size) * 3
    with torch.inference_mode():
        expected, _ = ref(x[None])
        gate_up = x @ ref.experts.gate_up_proj[0] + ref.experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.05, "the clamp is never reached"
        torch.testing.assert_close(ours(x), expected[0], rtol=1e-5, atol=1e-5)
        assert ours(x[:0]).shape == (0, config.hidden_size)


# ---------------------------------------------------------------- MXFP4
def random_mxfp4(gen: torch.Generator, *shape: int, scale_range: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks `[*shape[:-1], shape[-1] / 32, 16]` of random codes, scales `[..., shape[-1] / 32]`."""
    *rows, cols = shape
    blocks = torch.randint(0, 256, (*rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(*scale_range, (*rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizer_matches_transformers(dtype: torch.dtype) -> None:
    """Every code in both nibbles, scales over most of E8M0's range (2^-100 .. 2^+100)."""
    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4(gen, 3, 40, 96, scale_range=(27, 228))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.dtype == dtype and ours.shape == (3, 40, 96)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)
    byte = torch.tensor([[[0x71] + [0] * 15]], dtype=torch.uint8)  # low nibble 1 (0.5), high 7 (6.0)
    assert dequantize_mxfp4(byte, torch.tensor([[128]], dtype=torch.uint8), torch.float32)[0, :3].tolist() == [
        1.0, 12.0, 0.0]
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :-1], dtype)


def write_mxfp4_checkpoint(dense: Path, out: Path) -> None:
    """`out`: the tiny checkpoint `dense` with its expert weights replaced by random MXFP4 blocks and
    scales, laid out as OpenAI's release is: blocks in one file, scales and the rest in another (an
    index names them), config.json marked `quant_method: mxfp4`."""
    gen = torch.Generator().manual_seed(11)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, tensor in load_file(str(dense / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            shards[1][name] = tensor
            continue
        experts, d_in, d_out = tensor.shape  # transformers' [E, in, out]; MXFP4 rows are outputs
        shards[0][name + "_blocks"], shards[1][name + "_scales"] = random_mxfp4(
            gen, experts, d_out, d_in, scale_range=(122, 126))
    shutil.copytree(dense, out, ignore=shutil.ignore_patterns("model.safetensors"))
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for tensors, file in zip(shards, files, strict=True):
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    weight_map = {n: f for tensors, f in zip(shards, files, strict=True) for n in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_loads_and_matches(checkpoint: Path, tmp_path: Path) -> None:
    """The reference is transformers loading the same MXFP4 files, told to dequantize them: left to
    itself with `kernels` installed (transformers >= 5.25 requires it) it fetches its MXFP4 kernels
    from the Hugging Face Hub, which a test may not reach."""
    quantized = tmp_path / "mxfp4"
    write_mxfp4_checkpoint(checkpoint, quantized)
    reference = HFReference(quantized, quantization_config=Mxfp4Config(dequantize=True))
    check_logits(quantized, PROMPTS[:2], decode_steps=1, reference=reference)


def test_mxfp4_half_without_its_partner_is_named() -> None:
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_mxfp4(gen, 2, 8, 32, scale_range=(120, 130))
    weights = [("model.layers.3.mlp.experts.down_proj_blocks", blocks), ("model.norm.weight", torch.ones(4))]
    with pytest.raises(ValueError, match=r"without their blocks/scales partner: model\.layers\.3\.mlp\.experts"
                                         r"\.down_proj_blocks"):
        list(split_expert_tensors(weights, torch.float32, torch.device("cpu")))
    bad = [("model.layers.0.mlp.experts.down_proj_blocks", blocks),
           ("model.layers.0.mlp.experts.down_proj_scales", scales[:, :, :0])]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj: MXFP4 blocks"):
        list(split_expert_tensors(bad, torch.float32, torch.device("cpu")))



def test_tensor_parallel_expert_biases_sum_to_the_whole() -> None:
    """Two ranks' biased experts, loaded from the same checkpoint tensors: gate/up biases split with
    their rows, the down bias held by rank 0 alone, so the partial outputs sum to the one-rank output."""
    experts, hidden, inter = 4, 32, 48
    gen = torch.Generator().manual_seed(2)
    stacked = {"x.mlp.experts.gate_up_proj": torch.randn(experts, hidden, 2 * inter, generator=gen) * 0.5,
               "x.mlp.experts.gate_up_proj_bias": torch.randn(experts, 2 * inter, generator=gen) * 3,
               "x.mlp.experts.down_proj": torch.randn(experts, inter, hidden, generator=gen) * 0.3,
               "x.mlp.experts.down_proj_bias": torch.randn(experts, hidden, generator=gen)}

    def build(tp_size: int, tp_rank: int) -> FusedExperts:
        module = FusedExperts(experts, hidden, inter, bias=True, activation=GPT_OSS, tp_size=tp_size,
                              tp_rank=tp_rank, dtype=torch.float32)
        load_experts(module, stacked)
        return module

    whole, ranks = build(1, 0), [build(2, r) for r in (0, 1)]
    assert ranks[1].w13.bias.shape == (experts, inter) and not ranks[1].w2.bias.any()
    x = torch.randn(19, hidden) * 2
    weights, ids = select_experts(torch.randn(19, experts, generator=gen), 2, renormalize=True)
    partial = [rank(x, weights, ids) for rank in ranks]
    torch.testing.assert_close(partial[0] + partial[1], whole(x, weights, ids), rtol=1e-5, atol=1e-5)


def test_random_weights_route_a_batch_over_all_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.load_format = "random"` (the GPU benchmarks' gpt-oss-20b) draws biases as 0: drawn like
    the weights, gpt-oss's biases summed over the layers to a vector shared by every token, which sent
    64 decoding rows to 11-19 of 32 experts a layer and all but a few rows to one next token; the
    benchmarks' batch figures then read a fraction of the experts a real batch reads."""
    from rxf.testing.model_harness import ModelHarness

    shape = {"num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 128, "num_local_experts": 32,
             "num_experts_per_tok": 4, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}
    config_only = make_tiny_checkpoint(tmp_path, "GptOssForCausalLM", seed=1, **shape)
    (config_only / "model.safetensors").unlink()
    harness = ModelHarness(config_only, **{"model.load_format": "random", "scheduler.max_running_requests": 64})
    biases = [p for n, p in harness.runner.model.named_parameters() if n.endswith("bias")]
    assert len(biases) == 4 * 5 and not any(b.any() for b in biases)  # qkv, o, router, w13, w2
    rows, hit = 64, []
    forward = FusedExperts.forward

    def counting(self: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == rows:  # the decode steps (the prefill has 20 tokens a row)
            hit.append(ids.unique().numel())
        return forward(self, x, weights, ids)

    monkeypatch.setattr(FusedExperts, "forward", counting)
    rng = random.Random(0)
    out = harness.greedy([[rng.randrange(3, 500) for _ in range(20)] for _ in range(rows)], 3)
    assert len(hit) == 2 * 4 and min(hit) >= 28, hit  # uniform routing misses an expert with probability ~2e-4
    assert len({seq[-1] for seq in out}) > rows // 2
