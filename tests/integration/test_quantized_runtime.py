"""A quantized checkpoint through the whole engine (`Runtime`: scheduler and detokenizer processes,
batched and chunked prefill, decode, a second pass over cached prefixes): greedy tokens identical to
transformers running the dequantized float32 twin (on the CPU every method dequantizes at load, so
rxf computes with exactly the twin's weights). An FP8 Qwen3-MoE: block-wise FP8 experts and dense
layers, a dense MLP layer beside a sparse one, the router left dense. (Each format's layers are
checked against their twins in tests/unit/test_quantized_checkpoints.py; one engine start here.)"""

from __future__ import annotations

from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.model_parity import check_runtime_greedy
from rxf.testing.quantized_checkpoints import quantize_checkpoint
from rxf.testing.reference import HFReference

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
MOE = {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0]}
PROMPTS = [[(7 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate((21, 9, 30))]


def test_runtime_greedy_matches_the_dequantized_twin(tmp_path):
    dense = make_tiny_checkpoint(tmp_path / "dense", "Qwen3MoeForCausalLM", seed=2, initializer_range=0.1,
                                 **SHAPE, **MOE)
    quantized = quantize_checkpoint(dense, tmp_path / "q", "fp8", twin=tmp_path / "twin")
    check_runtime_greedy(quantized, PROMPTS, chunk=8, new_tokens=16, reference=HFReference(tmp_path / "twin"))
