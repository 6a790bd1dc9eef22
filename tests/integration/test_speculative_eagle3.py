"""EAGLE-3 heads (`speculative.method = "eagle3"`) in-process: the head's forward and every chain of
drafts against a plain-torch reimplementation of the documented forward (`rxf.testing.eagle3_reference`:
whole sequences, no KV cache), the radix tree's pair keys, and the loading errors of malformed heads.
A drafter that fed the wrong position, token, state or KV would propose other tokens than the
reference's chain.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.runner.model_runner import ModelInput
from rxf.core.sampling_params import SamplingParams
from rxf.testing.checkpoints import make_tiny_checkpoint, make_tiny_eagle3_head
from rxf.testing.eagle3_reference import Eagle3Reference, check_proposals, eagle3_engine, recording_scheduler
from rxf.testing.reference import HFReference, assert_logits_close

AUX_IDS = [1, 2, 3]  # inputs of target layers 1, 2, 3 (of 4): explicit, in vLLM's convention


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("eagle-target"), seed=1, num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle-head"), target, seed=3,
                                 eagle_aux_hidden_state_layer_ids=AUX_IDS)


@pytest.fixture(scope="module")
def reference(head, target):
    return Eagle3Reference(head, target, AUX_IDS)


def _config(target, head, **sections):
    base = {
        "model": {"path": str(target)}, "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"}, "cache": {"max_total_tokens": 2048},
        "speculative": {"method": "eagle3", "draft_model_path": str(head), "num_draft_tokens": 4, "max_batch_size": 8},
        "scheduler": {"chunked_prefill_size": 8},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return load_config(base)


@torch.inference_mode()
def test_head_forward_matches_the_reference(target, head, reference):
    """A prefill of the target gives its auxiliary states; the head's forward over them (every
    row's logits and features) equals the reference."""
    runner, drafter = eagle3_engine(_config(target, head))
    tokens = [5, 17, 33, 48, 17, 33, 60, 7, 9, 200, 3]
    row, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(tokens))
    _, aux = runner.forward_with_aux(ModelInput(ForwardMode.PREFILL, [row], tokens, [0], [len(tokens)], slots))
    want_aux, states = reference.target_states(tokens)
    torch.testing.assert_close(aux[:-1], want_aux, rtol=1e-4, atol=1e-4)
    n = len(tokens) - 1
    inp = ModelInput(ForwardMode.PREFILL, [row], tokens[1:], [0], [n], slots[:n], logits_start=[0], hidden=aux[:-1].clone())
    logits, features = drafter.runner.forward_with_aux(inp)
    want_logits, want_features = reference.head(states, tokens[1:])
    assert_logits_close(logits, want_logits)
    torch.testing.assert_close(features, want_features, rtol=1e-4, atol=1e-4)


def _request(rid, ids, max_new, **params):
    return PreparedRequest(rid, ids, SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0,
                                                               "ignore_eos": True, **params}))


def _drain(sched):
    out: dict[str, dict] = {}
    while sched.has_work:
        for o in sched.step():
            r = out.setdefault(o.rid, {"ids": []})
            r["ids"] += o.new_token_ids
            r["cached"] = o.cached_tokens
    return out


def test_every_draft_is_the_heads_greedy_chain(target, head, reference):
    """Batched prompts prefilled in chunks of 8, then a second pass from the radix cache and a
    prompt that shares a prefix but not the next token: every proposal is the reference's chain,
    and the outputs are transformers' greedy ones."""
    sched, proposals = recording_scheduler(_config(target, head))
    # The last prompt twice in one batch: the second one's chunks are handed to the tree after
    # the first's, so its row is re-pointed at the first one's slots as it goes.
    prompts = [[5, 17, 33, 48, 17, 33, 60, 7, 9], list(range(40, 70)), list(range(100, 120)), list(range(100, 120))]
    hf = HFReference(target)
    want = [hf.greedy(p, 12) for p in prompts]
    for attempt in ("first pass", "second pass"):
        for i, p in enumerate(prompts):
            sched.add_request(_request(f"{attempt}-{i}", p, 12))
        got = _drain(sched)
        assert [got[f"{attempt}-{i}"]["ids"] for i in range(4)] == want, attempt
    assert [got[f"second pass-{i}"]["cached"] for i in range(4)] == [len(p) - 1 for p in prompts]
    # The tree keys (token, next token): a prompt that leaves the cached sequence at position m
    # shares its first m - 1 positions only (the entry at m - 1 read the other next token).
    fork = prompts[1][:20] + [7, 8, 9]
    sched.add_request(_request("fork", fork, 6))
    got = _drain(sched)
    assert got["fork"]["cached"] == 19 and got["fork"]["ids"] == hf.greedy(fork, 6)
    assert len(proposals) > 20
    check_proposals(reference, proposals)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_retraction_keeps_drafts_and_outputs_exact(target, head, reference, overlap):
    """A KV pool too small for the batch retracts requests mid-generation: their KV (the head's
    entries with it) goes to the tree and is matched again on re-admission. With overlap, steps
    of more than 2 decoding requests do not speculate and overlap: the head absorbs a step's states
    after the next step was launched (in the runner's worker thread)."""
    scheduler = {"init_new_token_ratio": 0.01, "min_new_token_ratio": 0.01, "chunked_prefill_size": 8,
                 "overlap": overlap}
    spec = {"max_batch_size": 2} if overlap else {}
    config = _config(target, head, cache={"max_total_tokens": 120}, scheduler=scheduler, speculative=spec)
    sched, proposals = recording_scheduler(config)
    prompts = [list(range(10 * i + 3, 10 * i + 19)) for i in range(5)]
    for i, p in enumerate(prompts):
        sched.add_request(_request(f"r{i}", p, 20))
    got = _drain(sched)
    hf = HFReference(target)
    assert [got[f"r{i}"]["ids"] for i in range(5)] == [hf.greedy(p, 20) for p in prompts]
    assert sched.stats().extra["retractions"] > 0
    assert len(proposals) > 10
    check_proposals(reference, proposals)


def _corrupt(path, drop=(), replace=None, config=None):
    tensors = load_file(str(path / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    save_file(tensors, str(path / "model.safetensors"))
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"drop": ["fc.weight"]}, "parameters the checkpoint did not fill: fc.weight"),
        ({"drop": ["d2t"]}, "no d2t tensor"),
        ({"replace": {"d2t": torch.zeros(7, dtype=torch.int64)}}, "d2t must be an integer tensor [128]"),
        ({"replace": {"d2t": torch.full((128,), 10_000)}}, "d2t maps draft ids outside the target vocabulary"),
        ({"replace": {"fc.weight": torch.zeros(64, 100)}}, "cannot load checkpoint tensor fc.weight"),
        ({"config": {"vocab_size": 256}}, "vocab_size 256 is not the target's 512"),
        ({"config": {"architectures": ["LlamaForCausalLM"]}}, "LlamaForCausalLM is not a draft head"),
        ({"config": {"num_hidden_layers": 2}}, "one decoder layer are served; this one has 2"),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, "reads target layers [1, 2, 9]; the target has 4"),
    ],
    ids=["no-fc", "no-d2t", "d2t-shape", "d2t-range", "fc-shape", "vocab", "not-a-head", "layers", "aux-ids"],
)
def test_a_malformed_head_fails_to_load_naming_the_reason(tmp_path, target, damage, message):
    path = make_tiny_eagle3_head(tmp_path / "head", target, seed=3)
    _corrupt(path, **damage)
    with pytest.raises(ValueError, match="speculative.draft_model_path") as info:
        eagle3_engine(_config(target, path))
    assert message in str(info.value)
