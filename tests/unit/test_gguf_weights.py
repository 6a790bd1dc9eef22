"""`model.quantization = "gguf"`: a tiny Llama written as a GGUF by `rxf.testing.gguf_checkpoints`
(the `gguf` package quantizes; the test undoes llama.cpp's q / k row permutation by inverting its
row index) against transformers on the dequantized float32 twin.

Dequantized at load (`RXF_CPU_WEIGHT_PACKING=0`) rxf holds the twin's weights bit for bit, so logits
match to 1e-4 and greedy tokens are identical. Packed, the 4-bit layers run torch's int4 op in bf16
and the logits head torch's int8 op: within 3% of the logits' norm (tests/unit/test_cpu_weight_packing.py
says why; measured 1.1-1.3%).
"""

from __future__ import annotations

import pytest
import torch

from rxf.plugins.quantization import cpu_packing
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.gguf_checkpoints import write_gguf
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import check_logits
from rxf.testing.reference import HFReference

PROMPTS = [[5, 80, 17, 300, 42, 9, 77, 123], [400, 12, 33, 7, 250]]
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
GGUF = {"model.quantization": "gguf"}
# Layer 1's v projection in Q8_0: its fused qkv layer loads dense (all of q, k, v or none keep codes).
KINDS = {"ffn_down": "Q4_0", "blk.1.attn_v": "Q8_0"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    dense = make_tiny_checkpoint(root / "dense", seed=5, initializer_range=0.1, **SHAPE)
    return write_gguf(dense, root / "q", kinds=KINDS, twin=root / "twin"), root / "twin"


def test_dequantized_gguf_is_its_twin_bit_for_bit(checkpoints, monkeypatch):
    path, twin = checkpoints
    monkeypatch.setenv(cpu_packing.ENV, "0")
    ours = dict(ModelHarness(path, **GGUF).runner.model.named_parameters())
    theirs = dict(ModelHarness(twin).runner.model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name
    ref = HFReference(twin)
    check_logits(path, PROMPTS, reference=ref, decode_steps=2, **GGUF)
    assert ModelHarness(path, **GGUF).greedy(PROMPTS[:1], 12) == [ref.greedy(PROMPTS[0], 12)]


@pytest.mark.skipif(not cpu_packing.enabled(), reason="torch lacks the packed int4 CPU op")
def test_gguf_4bit_blocks_run_packed(checkpoints):
    path, twin = checkpoints
    harness = ModelHarness(path, **GGUF)
    layers = harness.runner.model.model.layers
    for layer, packed_qkv in ((layers[0], True), (layers[1], False)):
        assert hasattr(layer.self_attn.qkv_proj, "scales_and_zeros") == packed_qkv
        assert hasattr(layer.mlp.down_proj, "scales_and_zeros")  # Q4_0
        assert hasattr(layer.mlp.gate_up_proj, "scales_and_zeros")  # Q4_1
    assert hasattr(harness.runner.model.lm_head, "weight_int8")
    ref = HFReference(twin)
    for prompt, ours in zip(PROMPTS, harness.prefill_logits(PROMPTS), strict=True):
        theirs = ref.logits(prompt)
        assert 0 < ((ours - theirs).norm() / theirs.norm()).item() < 0.03


def test_gguf_needs_its_file(checkpoints):
    _, twin = checkpoints
    with pytest.raises(FileNotFoundError, match="must hold exactly one .gguf file, found 0"):
        ModelHarness(twin, **GGUF)
