"""Overlap scheduling changes no output: one workload through `Runtime` with `scheduler.overlap`
off and on, on a tiny checkpoint (CPU, the forward in the runner's worker thread when on), and with
two tensor-parallel gloo ranks.

The workload has what overlap has to get right: stop strings and stop tokens inside a step that was
already followed by another, a JSON schema with jump-forward, `n` seeded choices sharing one prefill,
an abort mid-stream, retraction under a KV pool too small for the load, and a long prompt prefilled in
chunks beside running decodes (mixed chunked prefill). Greedy outputs are also checked against
transformers.
"""

from __future__ import annotations

import json

import pytest
from grammar_cases import LONG_KEYS_SCHEMA

from rxf import Runtime
from rxf.testing.step_workload import run_step_workload, stop_points

# ~14 requests of up to ~200 tokens each in 240 slots, with an optimistic estimate of their future
# tokens: decode runs out of slots and retracts. A keyword override, since it outranks the RXF_*
# environment (RXF_CACHE__MAX_TOTAL_TOKENS would otherwise give a pool that never runs out).
POOL = {"cache.max_total_tokens": 240}


def _config(path, overlap: bool, tp: int = 1) -> dict:
    return {
        "model": {"path": str(path)},
        "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"},
        "scheduler": {"overlap": overlap, "chunked_prefill_size": 16, "max_running_requests": 8,
                      "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05},
        "parallel": {"tp_size": tp},
    }


@pytest.fixture(scope="module")
def workloads(tiny_llama):
    # The stop text and token come from an unstopped greedy run, so both stops really trigger.
    with Runtime.from_config(_config(tiny_llama, overlap=False), **POOL) as rt:
        stop_text, stop_token = stop_points(rt)
        runs = {False: run_step_workload(rt, stop_text, stop_token, LONG_KEYS_SCHEMA)}
    with Runtime.from_config(_config(tiny_llama, overlap=True), **POOL) as rt:
        runs[True] = run_step_workload(rt, stop_text, stop_token, LONG_KEYS_SCHEMA)
    return runs, stop_text, stop_token


def test_overlap_changes_no_output(workloads, hf_reference, tiny_llama):
    runs, stop_text, stop_token = workloads
    sync, overlap = runs[False], runs[True]
    for key in [k for k in sync if k not in ("stats", "aborted")]:
        assert overlap[key] == sync[key], key
    assert sync["stop_text"]["finish"] == {"type": "stop", "matched": stop_text}
    assert sync["stop_token"]["finish"] == {"type": "stop", "matched": stop_token}
    assert sync["eos"]["finish"]["type"] == "stop"  # this tiny model's EOS comes within 40 tokens
    json.loads(sync["json"]["text"])  # the schema's output is complete JSON
    assert sync["long"]["ids"] == hf_reference(sync["long_prompt"], 8)
    for run in (sync, overlap):
        assert 5 <= len(run["aborted"]) < 60
        assert run["stats"].extra["jump_forward_tokens"] > 0
        assert run["stats"].extra["retractions"] > 0, "the pool was meant to be too small"


def test_tensor_parallel_overlap_matches(tiny_llama, workloads):
    runs, stop_text, stop_token = workloads
    with Runtime.from_config(_config(tiny_llama, overlap=True, tp=2), **POOL) as rt:
        tp = run_step_workload(rt, stop_text, stop_token, LONG_KEYS_SCHEMA)
    for key in [k for k in runs[False] if k not in ("stats", "aborted")]:
        assert tp[key] == runs[False][key], key
