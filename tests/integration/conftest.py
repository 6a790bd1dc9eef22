from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rxf.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (GQA, llama3 rope scaling) with its tokenizer, shared by the session."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_checkpoint(
        path,
        "LlamaForCausalLM",
        seed=1,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )


@pytest.fixture(scope="session")
def hf_reference(tiny_llama):
    """Greedy continuation by transformers itself: full-sequence forward + argmax per step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    @torch.no_grad()
    def greedy(ids: list[int], n: int) -> list[int]:
        seq = torch.tensor([ids])
        out = []
        for _ in range(n):
            nxt = int(model(seq).logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        return out

    greedy.tokenizer = tokenizer
    return greedy
