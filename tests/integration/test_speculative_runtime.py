"""Speculative decoding (n-gram) through `Runtime` on a tiny checkpoint, against transformers.

The checkpoint is a tiny random Llama whose attention output is damped (x0.02): its greedy output
falls into short cycles that the n-gram proposer predicts, while attention still shapes every
logit, so drafts are both accepted and rejected. Greedy tokens must equal transformers' (chunked
prefill, a second pass from the radix cache, retraction under a tiny KV budget), and sampled
tokens must follow the exact distribution computed from transformers' logits (chi-square).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rxf import Runtime
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.distribution import chi_square_p, exact_prefixes, prefix_counts
from rxf.testing.model_parity import runtime_config
from rxf.testing.reference import HFReference

SPEC = {"method": "ngram", "num_draft_tokens": 4, "ngram_min_match": 1, "ngram_max_match": 3, "max_batch_size": 8}
PROMPTS = [[5, 17, 33, 48, 17, 33, 60, 7, 9], [100, 101, 102, 103, 100, 101], list(range(40, 70)), [9, 9, 9, 200]]


@pytest.fixture(scope="module")
def cyclic_model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-cyclic"), seed=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight"):
                p.mul_(0.02)
            elif name.endswith("down_proj.weight"):
                p.mul_(0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(cyclic_model):
    return HFReference(cyclic_model)


def _spec_runtime(path, **sections) -> Runtime:
    return Runtime.from_config(runtime_config(path, chunk=8, speculative=SPEC, **sections))


def test_greedy_equals_transformers_with_drafts_accepted(cyclic_model, reference):
    want = [reference.greedy(p, 40) for p in PROMPTS]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with _spec_runtime(cyclic_model) as rt:
        for attempt in ("first pass", "second pass (cached prefixes)"):
            outs = rt.generate(input_ids=PROMPTS, sampling_params=params)
            for i, (out, w) in enumerate(zip(outs, want, strict=True)):
                assert out["output_ids"] == w, f"{attempt}, prompt {i}"
        meta = [o["meta_info"] for o in outs]
    assert all(m["cached_tokens"] > 0 for m in meta), meta
    # 39 decoded tokens in fewer forwards: drafts were accepted.
    assert all(m["spec_verify_ct"] < 39 for m in meta) and min(m["spec_verify_ct"] for m in meta) < 30, meta


def test_retraction_under_a_tiny_kv_budget_keeps_greedy_exact(cyclic_model, reference):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(8, 20))] for _ in range(6)]
    want = [reference.greedy(p, 48) for p in prompts]
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    # Admission that barely counts future tokens lets decode run out of slots and retract.
    scheduler = {"init_new_token_ratio": 0.01, "min_new_token_ratio": 0.01}
    with _spec_runtime(cyclic_model, cache={"max_total_tokens": 180}, scheduler=scheduler) as rt:
        outs = rt.generate(input_ids=prompts, sampling_params=params)
        extra = rt.get_stats().extra
    assert [o["output_ids"] for o in outs] == want
    assert extra["retractions"] > 0 and extra["accepted_tokens"] > 0, extra


def test_sampling_with_drafts_keeps_the_target_distribution(cyclic_model, reference):
    """The first three tokens of 1200 seeded samples, with and without speculation, against the
    exact joint distribution from transformers' logits. The prompt holds each likely first token
    followed by its likeliest successor, so the third token is often sampled at a verified draft
    position (the second draft accepted) and otherwise after a rejection."""
    temperature, top_k, n = 0.8, 2, 1200
    prompt = list(PROMPTS[0])
    for _ in range(8):  # each likely first token appears in the prompt, before its likeliest successor
        firsts = reference.logits(prompt)[-1].topk(top_k).indices.tolist()
        if all(a in prompt for a in firsts):
            break
        prompt = [t for a in firsts for t in (a, int(reference.logits(prompt + [a])[-1].argmax()))] + prompt
    exact = exact_prefixes(lambda tokens: reference.logits(tokens)[-1], prompt, 3, temperature, top_k)
    params = [
        {"max_new_tokens": 5, "temperature": temperature, "top_k": top_k, "ignore_eos": True, "seed": i}
        for i in range(n)
    ]
    with_drafts = {**SPEC, "max_batch_size": 128}  # every decode step of the batch drafts
    for spec in (with_drafts, {"method": "none"}):
        config = runtime_config(cyclic_model, chunk=None, speculative=spec, scheduler={"max_running_requests": 128})
        with Runtime.from_config(config) as rt:
            outs = [o for i in range(0, n, 400) for o in rt.generate(input_ids=[prompt] * 400, sampling_params=params[i : i + 400])]
            extra = rt.get_stats().extra
        counts = prefix_counts([o["output_ids"] for o in outs], 3)
        p_value = chi_square_p(counts, exact)
        assert p_value > 1e-3, (spec["method"], p_value, counts, exact)
        if spec is with_drafts:
            assert 0 < extra["accepted_tokens"] < extra["drafted_tokens"], extra
