"""scheduler.policy = "priority" driven in-process on the tiny Llama: admission order, ties by
arrival, and which request retraction evicts. Greedy tokens are checked against transformers, and
the KV ledger after every step (`check_memory=True`)."""

from __future__ import annotations

import asyncio

import msgspec
from test_scheduler import make_scheduler, prompts, request

from rxf import Runtime
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.core.scheduler.scheduler import Scheduler


def with_priority(rid: str, ids: list[int], max_new: int, priority: int) -> PreparedRequest:
    # Streamed, so that progress shows in the outputs of every step.
    return msgspec.structs.replace(request(rid, ids, max_new), options=RequestOptions(stream=True, priority=priority))


def run(sched: Scheduler, outputs: dict[str, list[int]], max_steps: int = 10_000) -> tuple[list[str], list[str]]:
    """Step until idle; returns (rids in finishing order, rids in the order they were retracted).
    A retracted request is one that goes back from `running` to `waiting`."""
    finished: list[str] = []
    retracted: list[str] = []
    for _ in range(max_steps):
        if not sched.has_work:
            return finished, retracted
        running = {r.rid for r in sched.running}
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.rid)
        # Each victim is put at the front of `waiting`: this step's victims, in order, are reversed.
        retracted += reversed([r.rid for r in sched.waiting if r.rid in running])
    raise AssertionError("scheduler did not finish")


def test_one_at_a_time_runs_in_priority_order_ties_by_arrival(tiny_llama, hf_reference):
    ps = prompts(5, seed=11, lo=4, hi=12)
    priorities = [3, 1, 2, 1, -2]  # submitted low to high-ish, with a tie (p1, p3)
    outputs: dict[str, list[int]] = {}
    sched = make_scheduler(tiny_llama, **{"scheduler.policy": "priority", "scheduler.max_running_requests": 1})
    for i, (p, prio) in enumerate(zip(ps, priorities, strict=True)):
        sched.add_request(with_priority(f"p{i}", p, 6, prio))
    finished, retracted = run(sched, outputs)
    assert finished == ["p4", "p1", "p3", "p2", "p0"]
    assert retracted == []
    assert [outputs[f"p{i}"] for i in range(5)] == [hf_reference(p, 6) for p in ps]

    # The same requests under fcfs run in arrival order: the order above came from the policy.
    fcfs = make_scheduler(tiny_llama, **{"scheduler.policy": "fcfs", "scheduler.max_running_requests": 1})
    for i, p in enumerate(ps):
        fcfs.add_request(request(f"p{i}", p, 6))
    assert run(fcfs, {})[0] == [f"p{i}" for i in range(5)]


def _retraction_scenario(tiny_llama, low_priority: int) -> tuple[Scheduler, list[str], dict, dict]:
    """`lo` starts alone and decodes a few tokens (the most progress); then `hi` (priority 0) and
    `mid` (priority 1) join. Together they need ~3 x (10 + 30) slots of a 72-slot pool, and the
    optimistic estimate of future tokens (ratio 0.05) admits all three, so decode must retract."""
    sched = make_scheduler(
        tiny_llama,
        **{"scheduler.policy": "priority", "cache.max_total_tokens": 72,
           "scheduler.init_new_token_ratio": 0.05, "scheduler.min_new_token_ratio": 0.05},
    )
    ps = dict(zip(["lo", "hi", "mid"], prompts(3, seed=12, lo=10, hi=10), strict=True))
    outputs: dict[str, list[int]] = {}
    sched.add_request(with_priority("lo", ps["lo"], 30, low_priority))
    for _ in range(5):
        for out in sched.step():
            outputs.setdefault(out.rid, []).extend(out.new_token_ids)
    assert len(outputs["lo"]) == 5 and not sched.waiting
    sched.add_request(with_priority("hi", ps["hi"], 30, 0))
    sched.add_request(with_priority("mid", ps["mid"], 30, 1 if low_priority else 0))
    _, retracted = run(sched, outputs)
    return sched, retracted, {rid: outputs[rid] for rid in ps}, ps


def test_retraction_evicts_the_lowest_priority_first(tiny_llama, hf_reference):
    sched, retracted, outputs, ps = _retraction_scenario(tiny_llama, low_priority=5)
    assert sched.stats().extra["retractions"] == len(retracted) > 0
    assert retracted[0] == "lo"  # although it had made the most progress
    assert "hi" not in retracted
    # Retracted or not, every request's greedy tokens are those of transformers running it alone.
    assert outputs == {rid: hf_reference(p, 30) for rid, p in ps.items()}


def test_retraction_with_equal_priorities_evicts_the_least_progress(tiny_llama):
    # The control for the test above: the same requests all at priority 0 keep `lo`, which has
    # made the most progress, and retract a newcomer first.
    _, retracted, _, _ = _retraction_scenario(tiny_llama, low_priority=0)
    assert retracted and retracted[0] != "lo"


def test_tensor_parallel_ranks_agree_under_priority_and_retraction(tiny_llama, hf_reference):
    # Two gloo ranks each order and retract on their own: had they chosen differently, their
    # batches would differ and the collectives would hang or fail. Mixed priorities arriving
    # together, and a pool too small for all of them, exercise both choices.
    config = {
        "model": {"path": str(tiny_llama)}, "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"}, "parallel": {"tp_size": 2},
        "cache": {"max_total_tokens": 96}, "server": {"request_timeout_s": 60},  # a hang fails, not stalls CI
        "scheduler": {"policy": "priority", "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05},
    }
    ps = prompts(6, seed=13, lo=6, hi=12)
    params = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    with Runtime.from_config(config) as rt:

        async def submit() -> list[dict]:
            calls = [rt.async_generate(input_ids=p, sampling_params=params, priority=i % 3) for i, p in enumerate(ps)]
            return list(await asyncio.gather(*calls))

        outs = asyncio.run(submit())
        assert rt.get_stats().extra["retractions"] > 0
    assert [o["output_ids"] for o in outs] == [hf_reference(p, 30) for p in ps]
