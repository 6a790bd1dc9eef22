"""The scheduler driven in-process over a real ModelRunner on a tiny random checkpoint.

Greedy outputs are checked against transformers; the KV ledger (free + tree + requests == total)
is asserted after every step (`check_memory=True`).
"""

from __future__ import annotations

import random

import msgspec
import pytest
from transformers import AutoTokenizer

from rxf.core.config import load_config
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def make_scheduler(path, **overrides) -> Scheduler:
    config = load_config(
        {"model": {"path": str(path)}, "runtime": {"device": "cpu"}, "attention": {"backend": "torch_native"}},
        **overrides,
    )
    registry = PluginRegistry.load()
    runner = ModelRunner(config, registry, str(path))
    return Scheduler(config, runner, AutoTokenizer.from_pretrained(path), check_memory=True)


def request(rid: str, ids: list[int], max_new: int, **params) -> PreparedRequest:
    return PreparedRequest(rid, ids, SamplingParams.from_dict({"max_new_tokens": max_new, **GREEDY, **params}))


def drain(sched: Scheduler, max_steps: int = 10_000) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            return results
        for out in sched.step():
            r = results.setdefault(out.rid, {"ids": []})
            r["ids"] += out.new_token_ids
            r["cached"], r["finished"] = out.cached_tokens, out.finished
    raise AssertionError("scheduler did not finish")


def prompts(n: int, seed: int, vocab: int = 500, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# Overlap scheduling (the next step planned while the forward runs in the runner's worker thread)
# must give the same tokens as the synchronous step.
overlap = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


@overlap
def test_greedy_matches_transformers_with_prefix_cache(tiny_llama, hf_reference, overlap):
    sched = make_scheduler(tiny_llama, **{"scheduler.overlap": overlap})
    first = prompts(4, seed=0)
    expected = {f"a{i}": hf_reference(p, 32) for i, p in enumerate(first)}
    for i, p in enumerate(first):
        sched.add_request(request(f"a{i}", p, 32))
    got = drain(sched)
    assert {rid: r["ids"] for rid, r in got.items()} == expected
    assert all(r["finished"].type == "length" for r in got.values())

    # Second round: new suffixes on the cached prompts -> EXTEND over a cached prefix.
    second = [p + [7, 8, 9, 10][: i + 1] for i, p in enumerate(first)]
    for i, p in enumerate(second):
        sched.add_request(request(f"b{i}", p, 32))
    got = drain(sched)
    for i, p in enumerate(second):
        assert got[f"b{i}"]["ids"] == hf_reference(p, 32)
        assert got[f"b{i}"]["cached"] >= len(first[i]) - 1 > 0
    assert sched.stats().cache_hit_rate > 0


def test_disabled_cache_gives_same_tokens(tiny_llama, hf_reference):
    sched = make_scheduler(tiny_llama, **{"cache.disable_radix_cache": True})
    ps = prompts(3, seed=1)
    for i, p in enumerate(ps):
        sched.add_request(request(f"r{i}", p, 12))
    got = drain(sched)
    assert [got[f"r{i}"]["ids"] for i in range(3)] == [hf_reference(p, 12) for p in ps]
    assert all(r["cached"] == 0 for r in got.values())
    assert sched.runner.token_to_kv_pool.available_size() == sched.runner.token_to_kv_pool.num_slots


@overlap
def test_randomized_workload_keeps_ledger_and_flushes(tiny_llama, overlap):
    rng = random.Random(3)
    sched = make_scheduler(
        tiny_llama, **{"cache.max_total_tokens": 400, "scheduler.max_running_requests": 6, "scheduler.overlap": overlap,
                       "scheduler.chunked_prefill_size": 16, "scheduler.max_prefill_tokens": 48}
    )
    base = prompts(4, seed=4, hi=30)
    pending = []
    for i in range(30):  # shared prefixes, repeats, and different lengths
        p = list(rng.choice(base)) + prompts(1, seed=100 + i, lo=1, hi=20)[0]
        pending.append(request(f"w{i}", p, rng.randint(1, 24), temperature=rng.choice([0.0, 1.0]), ignore_eos=False))
    finished = set()
    while pending or sched.has_work:
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop())
        if rng.random() < 0.05 and sched.running:  # aborts release KV at once
            sched.abort(rng.choice(sched.running).rid)
        for out in sched.step():  # check_memory asserts the ledger after every step
            if out.finished:
                finished.add(out.rid)
    assert len(finished) == 30
    ok, _ = sched.flush_cache()
    assert ok
    pool = sched.runner.token_to_kv_pool
    assert pool.available_size() == pool.num_slots and sched.tree.total_size() == 0


@overlap
def test_retraction_under_small_kv_budget_keeps_outputs(tiny_llama, hf_reference, overlap):
    ps = prompts(8, seed=5, lo=10, hi=20)
    # ~8 x (15 + 40) tokens of demand for 200 slots, and an optimistic estimate of future tokens
    # (ratio 0.05), so admission lets too many in and decode must retract.
    sched = make_scheduler(
        tiny_llama, **{"cache.max_total_tokens": 200, "scheduler.max_running_requests": 8,
                       "scheduler.init_new_token_ratio": 0.05, "scheduler.min_new_token_ratio": 0.05,
                       "scheduler.overlap": overlap}
    )
    for i, p in enumerate(ps):
        sched.add_request(request(f"k{i}", p, 40))
    got = drain(sched)
    assert [got[f"k{i}"]["ids"] for i in range(8)] == [hf_reference(p, 40) for p in ps]
    assert sched.stats().extra["retractions"] > 0


@overlap
def test_prompt_logprobs(tiny_llama, overlap):
    sched = make_scheduler(tiny_llama, **{"scheduler.overlap": overlap})
    p = prompts(1, seed=6, lo=12, hi=12)[0]
    msg = msgspec.structs.replace(request("lp", p, 4), options=RequestOptions(return_logprob=True, logprob_start_len=0, top_logprobs_num=2))
    sched.add_request(msg)
    outs = []
    while sched.has_work:
        outs += sched.step()
    first = outs[0]
    assert first.input_token_logprobs[0] is None and len(first.input_token_logprobs) == len(p)
    assert all(v <= 0 for v in first.input_token_logprobs[1:])
    assert sum(len(o.output_token_logprobs or []) for o in outs) == 4


def test_zero_new_tokens_prefills_only(tiny_llama):
    sched = make_scheduler(tiny_llama)
    p = prompts(1, seed=8, lo=10, hi=10)[0]
    msg = msgspec.structs.replace(request("z", p, 0), options=RequestOptions(return_logprob=True, logprob_start_len=0))
    sched.add_request(msg)
    outs = []
    while sched.has_work:
        outs += sched.step()
    assert len(outs) == 1 and outs[0].new_token_ids == [] and outs[0].finished.type == "length"
    assert len(outs[0].input_token_logprobs) == len(p)
    # The prompt is now cached: a follow-up request reuses all but its last token.
    sched.add_request(request("z2", p, 2))
    got = drain(sched)
    assert got["z2"]["cached"] == len(p) - 1
