"""Tensor parallelism at the model level (Llama family, Mixtral, Phi-3, gpt-oss, Gemma 3): two gloo ranks (spawned processes, one thread each) run
the same greedy batch as one process, and must produce the same tokens and logits.

The one-rank run is itself checked against transformers in test_models.py; here the reference is
that run. fp32 tolerance: the sharded matmuls sum in a different order, so logits agree to ~1e-5
relative to the largest logit, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from rxf.core.runner.distributed import tp_all_gather
from rxf.plugins.models.layers import QKVParallelLinear, RowParallelLinear, VocabEmbedding
from rxf.testing import make_tiny_checkpoint
from rxf.testing.parallel import generate_each, load_and_generate, run_tp

PROMPTS = [[5, 80, 17, 300, 42, 9, 250, 11, 64, 3, 77], [400, 12], [99, 100, 101, 102, 103, 104]]
NEW_TOKENS = 32
VARIANTS = {
    # GQA: 4 query heads, 2 kv heads -> one kv head per rank; o_proj bias added after the reduce.
    "llama-gqa": ("LlamaForCausalLM", {"head_dim": 32, "attention_bias": True}),
    # 1 kv head for 2 ranks: replicated; tied embeddings; q/k/v biases; an odd vocabulary that
    # pads to 2 x 256 rows (the padding logit must never be returned).
    "qwen2-kv1": ("Qwen2ForCausalLM", {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 511}),
    # Experts split along their intermediate dimension; the router replicated on both ranks.
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Fused q|k|v and gate|up checkpoint tensors: each rank must take its rows of every piece.
    "phi3-fused": ("Phi3ForCausalLM", {}),
    # Sinks split with the query heads; expert biases: gate/up split with their rows, down on rank 0.
    "gpt-oss": ("GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
                                      "layer_types": ["sliding_attention", "full_attention"],
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}),
    # Per-head q/k norms replicated, scaled embeddings all-reduced, a local window of 4 on layer 0
    # (init 0.08: with sqrt(hidden)-scaled embeddings a larger one repeats one token).
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True, "sliding_window": 4,
                                     "initializer_range": 0.08, "layer_types": ["sliding_attention", "full_attention"]}),
}


def _config(path) -> dict:
    return {
        "model": {"path": str(path), "dtype": "float32"},
        "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"},
        "cache": {"max_total_tokens": 1024},
        "scheduler": {"max_running_requests": 4},
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        name: make_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, seed=3, **overrides)
        for name, (arch, overrides) in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def results(checkpoints):
    """Per variant: (one-rank result, [rank 0 result, rank 1 result]) of the greedy batch. The
    two-rank runs share one pair of spawned processes."""
    jobs = [(_config(path), str(path), PROMPTS, NEW_TOKENS) for path in checkpoints.values()]
    per_rank = run_tp(generate_each, 2, (jobs,))
    return {
        name: (load_and_generate(*job), [per_rank[0][i], per_rank[1][i]])
        for i, (name, job) in enumerate(zip(checkpoints, jobs, strict=True))
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_matches_tp1(results, variant):
    (ref_tokens, ref_logits), ranks = results[variant]
    assert len({t for seq in ref_tokens for t in seq}) > 5  # varied output exercises every position
    for tokens, logits in ranks:
        assert tokens == ref_tokens
        assert len(logits) == len(ref_logits) == NEW_TOKENS
        for ours, ref in zip(logits, ref_logits, strict=True):
            assert ours.shape == ref.shape  # the full (unpadded) vocabulary on every rank
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # Rank 1 receives exactly rank 0's logits (all-gather), so their sampling can never diverge.
    for a, b in zip(ranks[0][1], ranks[1][1], strict=True):
        assert torch.equal(a, b)


def test_shapes_per_rank_and_bad_tp_sizes():
    qkv = QKVParallelLinear(64, 16, num_heads=8, num_kv_heads=2, tp_size=4, tp_rank=3)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_head_start) == (2, 1, 1)
    assert qkv.weight.shape == ((2 + 1 + 1) * 16, 64)
    # Ranks 2 and 3 hold the q heads 4..7, which share kv head 1 (8 q heads / 2 kv heads = 4 per group).
    full = torch.arange(64 * 16 * 2.0).view(32, 64)
    qkv.weight_loader(qkv.weight, full, "k")
    assert torch.equal(qkv.weight[32:48], full[16:32])
    with pytest.raises(ValueError, match="num_attention_heads 6 is not divisible by tp_size 4"):
        QKVParallelLinear(64, 16, num_heads=6, num_kv_heads=2, tp_size=4, tp_rank=0)
    with pytest.raises(ValueError, match="num_key_value_heads 3 and tp_size 2"):
        QKVParallelLinear(64, 16, num_heads=6, num_kv_heads=3, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="in_features 10 is not divisible by tp_size 4"):
        RowParallelLinear(10, 8, tp_size=4, tp_rank=0)
    emb = VocabEmbedding(10, 4, tp_size=4, tp_rank=3)  # shards of 3 rows: rank 3 holds id 9 + 2 padding
    emb.weight_loader(emb.weight, torch.ones(10, 4))
    assert emb.num_real == 1 and emb.weight.sum() == 4
    assert torch.equal(tp_all_gather(torch.ones(2)), torch.ones(2))  # no group: one rank, unchanged
