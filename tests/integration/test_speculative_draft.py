"""Speculative decoding with a draft model (`speculative.method = "draft"`) through `Runtime`: tiny
random checkpoints sharing the tiny tokenizer, greedy tokens against transformers.

With the target as its own draft every draft is accepted (the accept length reaches k + 1: the
mechanics of running ahead, truncating and catching up are exercised at full speed); with a
different random model most are rejected. Either way the tokens must be the target's.
"""

from __future__ import annotations

import pytest

from rxf import Runtime
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.model_parity import runtime_config
from rxf.testing.reference import HFReference

PROMPTS = [[5, 17, 33, 48, 17, 33, 60, 7, 9], [100, 101, 102, 103, 100, 101], list(range(40, 70))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("target"), seed=1)
    other = make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), seed=2, num_hidden_layers=1)
    return target, other


def test_draft_model_greedy_equals_transformers(models):
    target, _ = models
    draft = target  # as its own draft: every draft is accepted
    ref = HFReference(target)
    want = [ref.greedy(p, 24) for p in PROMPTS]
    spec = {"method": "draft", "draft_model_path": str(draft), "num_draft_tokens": 4}
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Runtime.from_config(runtime_config(target, chunk=8, speculative=spec)) as rt:
        for attempt in ("first pass", "second pass (cached prefixes)"):
            outs = rt.generate(input_ids=PROMPTS, sampling_params=params)
            assert [o["output_ids"] for o in outs] == want, attempt
        extra = rt.get_stats().extra
    verify = [o["meta_info"]["spec_verify_ct"] for o in outs]
    # 23 decoded tokens in 5 forwards: 4 accepted drafts + a bonus token 4 times, then the last 3
    # tokens from 2 drafts (the budget left), in each of 2 passes over 3 prompts.
    assert verify == [5, 5, 5] and extra["accepted_tokens"] == 2 * 3 * (4 * 4 + 2), (verify, extra)


def test_draft_model_under_retraction_keeps_greedy_exact(models):
    """A different random model drafts (its drafts are rejected) and a tiny KV budget retracts requests
    mid-draft: their draft KV is freed with their target KV and rebuilt on re-admission."""
    target, other = models
    ref = HFReference(target)
    prompts = [list(range(10 * i + 3, 10 * i + 19)) for i in range(5)]
    want = [ref.greedy(p, 32) for p in prompts]
    spec = {"method": "draft", "draft_model_path": str(other), "num_draft_tokens": 4, "max_batch_size": 8}
    scheduler = {"init_new_token_ratio": 0.01, "min_new_token_ratio": 0.01}
    config = runtime_config(target, chunk=8, speculative=spec, cache={"max_total_tokens": 150}, scheduler=scheduler)
    with Runtime.from_config(config) as rt:
        outs = rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
        extra = rt.get_stats().extra
    assert [o["output_ids"] for o in outs] == want
    assert extra["retractions"] > 0 and extra["drafted_tokens"] > extra["accepted_tokens"], extra
