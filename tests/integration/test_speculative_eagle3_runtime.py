"""EAGLE-3 speculation through `Runtime` (scheduler and detokenizer processes), greedy tokens against
transformers.

A random head agrees with a random target almost never, so the target and the head here are made
to choose between the same two tokens A and B: every logits row but A's and B's is zero, A's reads
+x_0 and B's -x_0 of the normed hidden state (the target's final one, the head's feature). Both
then pick A or B by a sign their own computation decides, and agree about half the time: drafts are
accepted (runs of them too) and rejected, and the output still has to be the target's.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rxf import Runtime
from rxf.testing.checkpoints import make_tiny_checkpoint, make_tiny_eagle3_head
from rxf.testing.model_parity import runtime_config
from rxf.testing.reference import HFReference

PROMPTS = [[5, 17, 33, 48, 17, 33, 60, 7, 9], [100, 101, 102, 103, 100, 101], list(range(40, 70)), [9, 9, 9, 200]]
NEW = 24


def _two_token_head(weight: torch.Tensor, a: int, b: int) -> None:
    weight.zero_()
    weight[a, 0], weight[b, 0] = 1.0, -1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("eagle-ab-target"), seed=1, num_hidden_layers=4)
    head = make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle-ab-head"), target, seed=3)
    tensors = load_file(str(head / "model.safetensors"))
    hot = (torch.arange(tensors["d2t"].numel()) + tensors["d2t"]).tolist()  # draft id -> target id
    a, b = hot[10], hot[20]
    _two_token_head(tensors["lm_head.weight"], 10, 20)
    save_file(tensors, str(head / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        _two_token_head(model.lm_head.weight, a, b)
    model.save_pretrained(target)
    return target, head, (a, b)


@pytest.fixture(scope="module")
def runtime(models):
    target, head, _ = models
    spec = {"method": "eagle3", "draft_model_path": str(head), "num_draft_tokens": 4, "max_batch_size": 8}
    with Runtime.from_config(runtime_config(target, chunk=8, speculative=spec)) as rt:
        yield rt


@pytest.fixture(scope="module")
def want(models):
    ref = HFReference(models[0])
    return [ref.greedy(p, NEW) for p in PROMPTS]


def test_greedy_equals_transformers_with_drafts_accepted(models, runtime, want):
    params = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    for attempt in ("first pass", "second pass (cached prefixes)"):
        outs = runtime.generate(input_ids=PROMPTS, sampling_params=params)
        assert [o["output_ids"] for o in outs] == want, attempt
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    extra = runtime.get_stats().extra
    assert 0 < extra["accepted_tokens"] < extra["drafted_tokens"], extra
    verify = [o["meta_info"]["spec_verify_ct"] for o in outs]
    assert all(v < NEW - 1 for v in verify), verify  # fewer decode forwards than decoded tokens
    assert set(want[0]) == set(models[2])  # both tokens occur: the agreement is not trivial


def test_n_choices_and_stops_inside_accepted_spans(models, runtime, want):
    _, _, (a, b) = models
    outs = runtime.generate(input_ids=PROMPTS[2], sampling_params={"max_new_tokens": NEW, "temperature": 0,
                                                                   "ignore_eos": True}, n=3)
    assert [o["output_ids"] for o in outs] == [want[2]] * 3
    # Stop at the first B of each output: it ends there whichever step (and draft) emitted it.
    outs = runtime.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": NEW, "temperature": 0,
                                                                "ignore_eos": True, "stop_token_ids": [b]})
    for out, w in zip(outs, want, strict=True):
        end = w.index(b) + 1 if b in w else NEW
        assert out["output_ids"] == w[:end]
        assert out["meta_info"]["finish_reason"]["type"] == ("stop" if b in w else "length")
