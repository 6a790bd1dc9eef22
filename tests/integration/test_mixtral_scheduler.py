"""A tiny random Mixtral served by the scheduler in-process (batched prefill and decode, prefix
cache, KV ledger checked every step): 32 greedy tokens per prompt for a batch of prompts equal
transformers' own greedy continuation."""

from __future__ import annotations

import pytest
import torch
from test_scheduler import drain, make_scheduler, prompts, request
from transformers import AutoModelForCausalLM

from rxf.testing.checkpoints import make_tiny_checkpoint

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-mixtral"), "MixtralForCausalLM", seed=3)


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Full-sequence forward + argmax per step, eos included (the requests ignore eos)."""
    seq = torch.tensor([ids])
    for _ in range(n):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids):].tolist()


def test_batch_greedy_matches_transformers(tiny_mixtral):
    hf = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()
    sched = make_scheduler(tiny_mixtral)
    batch = prompts(5, seed=11)
    for i, p in enumerate(batch):
        sched.add_request(request(f"m{i}", p, NEW_TOKENS))
    got = drain(sched)
    assert [got[f"m{i}"]["ids"] for i in range(len(batch))] == [hf_greedy(hf, p, NEW_TOKENS) for p in batch]

    # The same prompts extended: EXTEND over cached prefixes, batched with each other.
    longer = [p + [40 + i, 41] for i, p in enumerate(batch)]
    for i, p in enumerate(longer):
        sched.add_request(request(f"x{i}", p, NEW_TOKENS))
    got = drain(sched)
    assert all(got[f"x{i}"]["cached"] > 0 for i in range(len(longer)))
    assert [got[f"x{i}"]["ids"] for i in range(len(longer))] == [hf_greedy(hf, p, NEW_TOKENS) for p in longer]
