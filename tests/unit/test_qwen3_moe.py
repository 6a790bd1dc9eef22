"""Qwen3MoeForCausalLM against transformers on tiny random checkpoints (`rxf.testing.model_parity`):
logits of batched prefill, decode and a cached-prefix extend within 1e-4, 24 greedy tokens through
the whole engine (batched, chunked prefill at 8, a second pass over cached prefixes), both
checkpoint layouts (per-expert tensors and transformers' fused stacks), and which layers are sparse.

Quirks in the configs: 8 and 16 experts with top 4, `norm_topk_prob` on and off, expert width
(`moe_intermediate_size` 32) unlike the dense layers' (128), a dense layer among sparse ones (by
`mlp_only_layers` and by `decoder_sparse_step`), head_dim 32 != hidden / heads, GQA, tied embeddings,
and a 16-token window on every layer (transformers' Qwen3-MoE has no layer_types) with prompts of
40-117 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_qwen3 import variant_checkpoints

from rxf.plugins.models.llama import LlamaMLP
from rxf.plugins.models.mixtral import MixtralMoE
from rxf.plugins.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import assert_logits_close, check_logits, check_runtime_greedy
from rxf.testing.reference import HFReference

MOE = {"head_dim": 32, "moe_intermediate_size": 32, "num_experts_per_tok": 4}
VARIANTS = {
    "8x4-renormalised": {**MOE, "num_experts": 8, "norm_topk_prob": True, "mlp_only_layers": [0]},
    "16x4-raw-tied-window": {**MOE, "num_experts": 16, "norm_topk_prob": False, "decoder_sparse_step": 2,
                             "tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 16},
}
PROMPTS = [[(11 * i + 5 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((61, 40, 117))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, HFReference]]:
    return variant_checkpoints(tmp_path_factory, "Qwen3MoeForCausalLM", VARIANTS, seed=4)


@pytest.fixture(params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, checkpoints):
    return checkpoints[request.param]


def test_logits_match_transformers(checkpoint) -> None:
    path, ref = checkpoint
    check_logits(path, PROMPTS, reference=ref)


def test_runtime_greedy_matches_transformers(checkpoints) -> None:
    path, ref = checkpoints["16x4-raw-tied-window"]  # one engine per module
    check_runtime_greedy(path, PROMPTS, chunk=8, new_tokens=24, reference=ref)


def test_fused_expert_checkpoint_loads_the_same(checkpoints, tmp_path: Path) -> None:
    """transformers 5 writes its in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) with save_original_format=False; rxf loads it too."""
    path, ref = checkpoints["8x4-renormalised"]
    ref.model.save_pretrained(tmp_path, save_original_format=False)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    check_logits(tmp_path, PROMPTS[:2], reference=ref, decode_steps=1)


def test_sparse_layers_are_where_transformers_puts_them(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  vocab_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                                  mlp_only_layers=[3])
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
        ours = Qwen3MoeForCausalLM(config, torch.float32)
    theirs = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert theirs == [False, True, False, False, False, True]  # step 2 gives 1, 3, 5; 3 is dense
    assert [is_sparse_layer(config, i) for i in range(6)] == theirs
    assert [isinstance(layer.mlp, MixtralMoE) for layer in ours.model.layers] == theirs
    assert all(isinstance(layer.mlp, LlamaMLP) for layer, sparse in zip(ours.model.layers, theirs, strict=True)
               if not sparse)


def test_norm_topk_prob_is_honoured(checkpoints) -> None:
    """Flipping the renormalisation moves the logits out of tolerance: the variants test it."""
    for name in VARIANTS:
        path, ref = checkpoints[name]
        harness = ModelHarness(path)
        for layer in harness.runner.model.model.layers:
            if isinstance(layer.mlp, MixtralMoE):
                layer.mlp.renormalize = not layer.mlp.renormalize
        with pytest.raises(AssertionError):
            assert_logits_close(harness.prefill_logits(PROMPTS[:1])[0], ref.logits(PROMPTS[0]))


def test_missing_and_misshapen_expert_tensors_are_named(checkpoints) -> None:
    path, ref = checkpoints["8x4-renormalised"]
    ckpt = load_file(str(path / "model.safetensors"))
    model = Qwen3MoeForCausalLM(ref.model.config, torch.float32)
    missing = "model.layers.1.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=r"mlp\.experts\.w13\.weight \(shard \(5, 1\)\)"):
        model.load_weights((n, t) for n, t in ckpt.items() if n != missing)
    fused = {"model.layers.1.mlp.experts.down_proj": torch.zeros(8, 64)}
    with pytest.raises(ValueError, match=r"experts\.down_proj has shape \(8, 64\): expected \[experts, hidden"):
        model.load_weights(fused.items())
