"""Our Mixtral (torch path on CPU, fp32) against transformers on tiny random checkpoints: the MoE block
alone, logits through ModelRunner (prefill, decode, cached-prefix extend), weight loading, and the
tensor-parallel split of the experts (two ranks' partial outputs sum to the whole).

Logits tolerance as in test_models.py: 1e-4 relative to the largest logit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_models import PROMPTS, Requests, assert_logits_close, hf_logits, registry
from transformers import AutoModelForCausalLM, MixtralConfig

from rxf.core.config import load_config
from rxf.core.runner.model_runner import ModelRunner
from rxf.plugins.models.layers.moe import FusedExperts, experts_native, select_experts
from rxf.plugins.models.mixtral import MixtralForCausalLM, MixtralMoE
from rxf.testing import make_tiny_checkpoint

# Mixtral's own routing (8 experts, top 2), and a wider top-k where renormalisation matters more.
VARIANTS = {"8x2": {}, "6x3": {"num_local_experts": 6, "num_experts_per_tok": 3, "head_dim": 32}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp(f"mixtral-{request.param}"), "MixtralForCausalLM", seed=2,
        **VARIANTS[request.param],
    )
    config = load_config(None, **{"attention.backend": "torch_native", "runtime.device": "cpu",
                                  "model.dtype": "float32", "cache.max_total_tokens": 2048})
    runner = ModelRunner(config, registry(), str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return runner, hf, path


def tiny_config(**overrides) -> MixtralConfig:
    kwargs = {"hidden_size": 32, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, **overrides}
    return MixtralConfig(**kwargs)


def checkpoint_experts(num_experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """Per-expert tensors named as in a checkpoint, relative to the MoE block."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for e in range(num_experts):
        for name, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            out[f"experts.{e}.{name}.weight"] = torch.randn(shape, generator=gen) * 0.3
    return out


def load_experts(experts: FusedExperts, tensors: dict[str, torch.Tensor]) -> None:
    shards = {"w1": (experts.w13, 0), "w3": (experts.w13, 1), "w2": (experts.w2, 0)}
    for name, tensor in tensors.items():
        _, e, proj, _ = name.split(".")
        module, j = shards[proj]
        module.weight_loader(module.weight, tensor, (int(e), j))


def test_moe_block_matches_transformers() -> None:
    # Imported here: the module imports triton, which must wait until the Triton interpreter tests
    # have set TRITON_INTERPRET (pytest imports every test module before running any).
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = tiny_config(num_local_experts=5, num_experts_per_tok=2)
    torch.manual_seed(0)
    ref = MixtralSparseMoeBlock(config).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MixtralMoE(config, torch.float32)
    inter = config.intermediate_size
    ours.gate.weight.data.copy_(ref.gate.weight)
    load_experts(ours.experts, {
        **{f"experts.{e}.w1.weight": ref.experts.gate_up_proj[e, :inter] for e in range(5)},
        **{f"experts.{e}.w3.weight": ref.experts.gate_up_proj[e, inter:] for e in range(5)},
        **{f"experts.{e}.w2.weight": ref.experts.down_proj[e] for e in range(5)},
    })
    x = torch.randn(37, config.hidden_size)
    with torch.inference_mode():
        expected = ref(x[None])[0]
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
        assert ours(x[:0]).shape == (0, config.hidden_size)


def test_router_renormalises_the_top_k_of_a_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.5]])
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert ids.tolist() == [[0, 1], [2, 3]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(weights[0], probs[0, :2] / probs[0, :2].sum())
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    raw, _ = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(raw[1], probs[1, [2, 3]])


def test_prefill_decode_and_extend_logits_match_hf(pair) -> None:
    runner, hf, _ = pair
    assert isinstance(runner.model, MixtralForCausalLM)
    reqs = Requests(runner, PROMPTS)
    expected = [hf_logits(hf, p) for p in PROMPTS]
    assert_logits_close(reqs.prefill(logits_start=[0, 0, 0]), torch.cat(expected))
    for step in range(3):
        logits = reqs.decode([7 + step, 200 + step, 450 - step])
        assert_logits_close(logits, torch.stack([hf_logits(hf, t)[-1] for t in reqs.tokens]))


def test_greedy_32_tokens_match_hf(pair) -> None:
    runner, hf, _ = pair
    reqs = Requests(runner, PROMPTS)
    generated: list[list[int]] = [[] for _ in PROMPTS]
    next_tokens = reqs.prefill().argmax(-1).tolist()
    for _ in range(32):
        for out, token in zip(generated, next_tokens, strict=True):
            out.append(token)
        if len(generated[0]) == 32:
            break
        next_tokens = reqs.decode(next_tokens).argmax(-1).tolist()
    eos = set(runner.eos_token_ids)
    for prompt, ours in zip(PROMPTS, generated, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)[0, len(prompt):]
        stop = next((i + 1 for i, t in enumerate(ours) if t in eos), len(ours))  # HF stops at eos
        assert ours[:stop] == ref.tolist()


def test_weights_land_in_the_fused_layout(pair) -> None:
    runner, _, path = pair
    ckpt = load_file(str(Path(path) / "model.safetensors"))
    layer = runner.model.model.layers[1].mlp
    pre = "model.layers.1.block_sparse_moe."
    torch.testing.assert_close(layer.gate.weight, ckpt[pre + "gate.weight"], rtol=0, atol=0)
    for e in range(layer.experts.w13.weight.shape[0]):
        w1, w3, w2 = (ckpt[f"{pre}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
        torch.testing.assert_close(layer.experts.w13.weight[e], torch.cat([w1, w3]), rtol=0, atol=0)
        torch.testing.assert_close(layer.experts.w2.weight[e], w2, rtol=0, atol=0)


def test_missing_or_unexpected_expert_tensors_are_named(pair) -> None:
    runner, _, path = pair
    ckpt = load_file(str(Path(path) / "model.safetensors"))
    model = MixtralForCausalLM(runner.model.config, dtype=torch.float32)
    missing = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    with pytest.raises(ValueError, match=r"mlp\.experts\.w13\.weight \(shard \(2, 1\)\)"):
        model.load_weights((n, t) for n, t in ckpt.items() if n != missing)
    extra = "model.layers.0.block_sparse_moe.experts.99.w1.weight"
    with pytest.raises(ValueError, match=extra.replace(".", r"\.")):
        model.load_weights([*ckpt.items(), (extra, ckpt[missing])])
    wrong = {**ckpt, missing: ckpt[missing][:, :-1]}
    with pytest.raises(ValueError, match=r"experts\.2\.w3\.weight.*checkpoint shape \(128, 63\)"):
        model.load_weights(wrong.items())


def test_tensor_parallel_shards_sum_to_the_whole() -> None:
    """Two ranks' experts, each loaded from the same full checkpoint tensors, give partial outputs
    whose sum (what tp_all_reduce computes) is the one-rank output."""
    num_experts, hidden, inter = 4, 32, 48
    tensors = checkpoint_experts(num_experts, hidden, inter)
    whole = FusedExperts(num_experts, hidden, inter, tp_size=1, tp_rank=0, dtype=torch.float32)
    load_experts(whole, tensors)
    ranks = [FusedExperts(num_experts, hidden, inter, tp_size=2, tp_rank=r, dtype=torch.float32) for r in (0, 1)]
    for rank in ranks:
        load_experts(rank, tensors)
        assert rank.w13.weight.shape == (num_experts, inter, hidden)
        assert rank.w2.weight.shape == (num_experts, hidden, inter // 2)
    x = torch.randn(19, hidden)
    weights, ids = select_experts(torch.randn(19, num_experts), 2, renormalize=True)
    partial = [rank(x, weights, ids) for rank in ranks]
    torch.testing.assert_close(partial[0] + partial[1], whole(x, weights, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="intermediate_size 48 is not divisible by tp_size 5"):
        FusedExperts(num_experts, hidden, inter, tp_size=5, tp_rank=0)


def test_native_experts_skip_unused_experts() -> None:
    """Experts with no token are skipped; a token's output is the weighted sum of its experts'."""
    num_experts, hidden, inter = 4, 16, 24
    w13 = torch.randn(num_experts, 2 * inter, hidden)
    w2 = torch.randn(num_experts, hidden, inter)
    x = torch.randn(3, hidden)
    ids = torch.tensor([[3, 1], [1, 3], [3, 1]])  # experts 0 and 2 unused
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        gate, up = (w13[e] @ v).chunk(2)
        return w2[e] @ (torch.nn.functional.silu(gate) * up)

    expected = torch.stack([sum(w * expert(int(e), x[t]) for w, e in zip(weights[t], ids[t], strict=True))
                            for t in range(3)])
    torch.testing.assert_close(experts_native(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)
