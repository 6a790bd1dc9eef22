"""EAGLE-3 tree drafts (`speculative.tree_topk` > 1) in-process: every node's children are among the
reference head's top-k after that node's path (`rxf.testing.eagle3_reference`: whole sequences, no
KV cache, so a node fed the wrong feature, position or ancestors' K/V would have other children),
and the outputs are transformers' greedy ones, batched, from the radix cache, under retraction,
with stops and `n` > 1; a tree's accepted span is put at the positions its path gives (the KV
ledger is checked every step).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rxf import Runtime
from rxf.core.config import load_config
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.sampling_params import SamplingParams
from rxf.testing.checkpoints import make_tiny_checkpoint, make_tiny_eagle3_head
from rxf.testing.distribution import chi_square_p, exact_prefixes, prefix_counts
from rxf.testing.eagle3_reference import Eagle3Reference, check_tree_proposals, recording_scheduler
from rxf.testing.model_parity import runtime_config
from rxf.testing.reference import HFReference

AUX_IDS = [1, 2, 3]
TREE = {"tree_topk": 3, "tree_depth": 3, "num_draft_tokens": 6}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tree-target"), seed=1, num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("tree-head"), target, seed=3,
                                 eagle_aux_hidden_state_layer_ids=AUX_IDS)


def _config(target, head, backend="torch_native", **sections):
    base = {
        "model": {"path": str(target)}, "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": backend}, "cache": {"max_total_tokens": 2048},
        "speculative": {"method": "eagle3", "draft_model_path": str(head), "max_batch_size": 8, **TREE},
        "scheduler": {"chunked_prefill_size": 8},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return load_config(base)


def _request(rid, ids, max_new, **params):
    return PreparedRequest(rid, ids, SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0,
                                                               "ignore_eos": True, **params}))


def _drain(sched):
    out: dict[str, list[int]] = {}
    while sched.has_work:
        for o in sched.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_every_tree_node_has_the_reference_heads_top_children(target, head, backend):
    sched, proposals = recording_scheduler(_config(target, head, backend))
    prompts = [[5, 17, 33, 48, 17, 33, 60, 7, 9], list(range(40, 70)), list(range(100, 120))]
    hf = HFReference(target)
    want = [hf.greedy(p, 10) for p in prompts]
    for attempt in ("first pass", "second pass (cached prefixes)"):
        for i, p in enumerate(prompts):
            sched.add_request(_request(f"{attempt}-{i}", p, 10))
        got = _drain(sched)
        assert [got[f"{attempt}-{i}"] for i in range(3)] == want, attempt
    trees = [p for p in proposals if len(p) == 3]
    assert len(trees) > 10 and any(len(set(parents)) < len(parents) for _, _, parents in trees)  # real branching
    check_tree_proposals(Eagle3Reference(head, target, AUX_IDS), trees, TREE["tree_topk"])


def test_tree_drafts_under_retraction_stops_and_n(target, head):
    # Steps of 40 prompt tokens: the five 16-token prompts prefill in three steps (two of them cut),
    # so their decodes grow together past the 140-token cache (with 8, one prompt a step, they did not).
    scheduler = {"init_new_token_ratio": 0.01, "min_new_token_ratio": 0.01, "chunked_prefill_size": 40}
    sched, _ = recording_scheduler(_config(target, head, cache={"max_total_tokens": 140}, scheduler=scheduler))
    prompts = [list(range(10 * i + 3, 10 * i + 19)) for i in range(5)]
    hf = HFReference(target)
    want = [hf.greedy(p, 20) for p in prompts]
    for i, p in enumerate(prompts):
        sched.add_request(_request(f"r{i}", p, 20))
    got = _drain(sched)
    assert [got[f"r{i}"] for i in range(5)] == want
    assert sched.stats().extra["retractions"] > 0
    # A stop token inside the tree's accepted span cuts the output there.
    stop = want[0][5]
    sched.add_request(_request("stop", prompts[0], 20, stop_token_ids=[stop]))
    assert _drain(sched)["stop"] == want[0][: want[0].index(stop) + 1]


@pytest.fixture(scope="module")
def two_token_models(tmp_path_factory):
    """A target and a head that both choose between tokens A and B (see
    test_speculative_eagle3_runtime.py), the head's draft vocabulary being just those two: with
    tree_topk 2 every expanded node's children are both. The target's other logits are its random
    ones x 0.01 (small, but no ties for top-k sampling to break)."""
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("tree-ab-target"), seed=1, num_hidden_layers=4)
    head = make_tiny_eagle3_head(tmp_path_factory.mktemp("tree-ab-head"), target, seed=3, draft_vocab_size=2)
    tensors = load_file(str(head / "model.safetensors"))
    a, b = (torch.arange(2) + tensors["d2t"]).tolist()
    tensors["lm_head.weight"].zero_()
    tensors["lm_head.weight"][0, 0], tensors["lm_head.weight"][1, 0] = 1.0, -1.0
    save_file(tensors, str(head / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.01)
        model.lm_head.weight[a].zero_()
        model.lm_head.weight[b].zero_()
        model.lm_head.weight[a, 0], model.lm_head.weight[b, 0] = 1.0, -1.0
    model.save_pretrained(target)
    return target, head


def test_a_tree_accepts_more_per_verify_than_a_chain(two_token_models):
    """Where the head's top choice is the target's about half the time, a chain accepts a run
    only while they agree; a tree holding both choices at every node accepts whatever the target
    picks, down to the tree's depth (here the whole binary tree of depth 3: 14 drafts)."""
    target, head = two_token_models
    prompts = [[5, 17, 33, 48, 17, 33, 60, 7, 9], list(range(40, 70)), [9, 9, 9, 200]]
    hf = HFReference(target)
    want = [hf.greedy(p, 24) for p in prompts]
    verify = {}
    for name, spec in {"chain": {"tree_topk": 1, "num_draft_tokens": 3}, "tree": {"tree_topk": 2, "tree_depth": 3,
                                                                                  "num_draft_tokens": 14}}.items():
        sched, _ = recording_scheduler(_config(target, head, speculative=spec))
        for i, p in enumerate(prompts):
            sched.add_request(_request(f"{name}{i}", p, 24))
        got = _drain(sched)
        assert [got[f"{name}{i}"] for i in range(3)] == want, name
        verify[name] = sched.stats().extra["verify_steps"]
        if name == "tree":  # n > 1: three choices of one prompt, each the greedy output
            for j in range(3):
                sched.add_request(_request(f"n{j}", prompts[1], 24))
            got = _drain(sched)
            assert [got[f"n{j}"] for j in range(3)] == [want[1]] * 3
    assert verify["tree"] < verify["chain"], verify


def test_sampling_with_tree_drafts_keeps_the_target_distribution(two_token_models):
    """The first three tokens of 1200 seeded samples (temperature 0.8, top-k 2: the target's A or
    B and one other token), with tree drafts, against the exact joint distribution from
    transformers' logits: a sample of A or B is accepted down the tree, another one ends the
    step."""
    target, head = two_token_models
    temperature, top_k, n = 0.8, 2, 1200
    prompt = [5, 17, 33, 48, 17, 33, 60, 7, 9]
    hf = HFReference(target)
    exact = exact_prefixes(lambda tokens: hf.logits(tokens)[-1], prompt, 3, temperature, top_k)
    params = [{"max_new_tokens": 4, "temperature": temperature, "top_k": top_k, "ignore_eos": True, "seed": i}
              for i in range(n)]
    spec = {"method": "eagle3", "draft_model_path": str(head), "tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 14,
            "max_batch_size": 128}
    config = runtime_config(target, chunk=None, speculative=spec, scheduler={"max_running_requests": 128})
    with Runtime.from_config(config) as rt:
        outs = [o for i in range(0, n, 400) for o in rt.generate(input_ids=[prompt] * 400, sampling_params=params[i : i + 400])]
        extra = rt.get_stats().extra
    counts = prefix_counts([o["output_ids"] for o in outs], 3)
    p_value = chi_square_p(counts, exact)
    assert p_value > 1e-3, (p_value, counts, exact)
    assert 0 < extra["accepted_tokens"] < extra["drafted_tokens"], extra
