"""`Runtime` with tensor-parallel ranks (two gloo scheduler processes) and with data-parallel
replicas (two scheduler groups behind one TokenizerManager), end to end on a tiny checkpoint.

Greedy tokens are checked against transformers (`hf_reference`); one torch thread per rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rxf import Runtime
from rxf.core.frontend.tokenizer_manager import EngineDeadError
from rxf.core.launch.processes import EngineStartError
from rxf.core.runner.placement import free_port

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = ["the cat", "a much longer prompt about the dog and the cat", "你好", "numbers 1 2 3"]


def _config(path, **parallel):
    return {
        "model": {"path": str(path)},
        "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"},
        "cache": {"max_total_tokens": 2048},
        "parallel": parallel,
    }


def test_tp2_runtime_matches_transformers_and_reports_a_dead_rank(tiny_llama, hf_reference):
    with Runtime.from_config(_config(tiny_llama, tp_size=2)) as rt:
        schedulers = [p for p in rt.engine.procs if p.name.startswith("rxf-scheduler")]
        assert [p.name for p in schedulers] == ["rxf-scheduler-dp0-tp0", "rxf-scheduler-dp0-tp1"]
        assert rt.engine.info["tp_size"] == 2
        outs = rt.generate(PROMPTS, [{"max_new_tokens": n, **GREEDY} for n in (32, 20, 9, 32)])
        for prompt, out, n in zip(PROMPTS, outs, (32, 20, 9, 32), strict=True):
            assert out["output_ids"] == hf_reference(rt.tokenizer.encode(prompt), n)
        # Seeded sampling: every rank draws the same tokens (else the ranks' batches would diverge
        # and the engine would hang or fail), and a seed reproduces its output.
        sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_new_tokens": 24, "ignore_eos": True}
        first, again = rt.generate(["sampling test", "sampling test"], [sampled, sampled])
        assert first["output_ids"] == again["output_ids"]
        unseeded = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True}
        assert all(o["meta_info"]["completion_tokens"] == 24 for o in rt.generate(PROMPTS, unseeded))
        stream = list(rt.generate(PROMPTS[1], {"max_new_tokens": 12, **GREEDY}, stream=True))
        assert sum((c["output_ids"] for c in stream), []) == outs[1]["output_ids"][:12]
        assert stream[-1]["meta_info"]["cached_tokens"] > 0  # rank 0's radix cache, shared decisions
        ok, message = rt.flush_cache()
        assert ok, message

        # Constrained requests beside free ones: grammars compile on every rank and become
        # admissible at the same step on both (else the ranks' batches would differ and hang).
        pattern = r"(yes|no)(, (yes|no)){2}\."
        constrained = {"max_new_tokens": 40, "temperature": 0, "regex": pattern}
        mixed = rt.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                            [constrained, {"max_new_tokens": 20, **GREEDY}, constrained])
        for out in (mixed[0], mixed[2]):
            assert re.fullmatch(pattern, out["text"]), out["text"]
            assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert mixed[1]["output_ids"] == outs[1]["output_ids"]

        # A rank that dies makes the engine report dead, as a lone scheduler does.
        rt.generate("warm", {"max_new_tokens": 1})
        os.kill(schedulers[1]._popen.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="rxf-scheduler-dp0-tp1 exited"):
            while time.monotonic() - start < 10:
                rt.generate("doomed", {"max_new_tokens": 4})
                time.sleep(0.1)


def test_dp2_routes_repeated_prefix_to_the_same_replica(tiny_llama, hf_reference):
    # Prompts of 40+ tokens: the router indexes whole blocks of 16 tokens.
    a = "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun " * 2
    b = "serving engines batch many requests and reuse cached keys and values of shared prefixes " * 2
    with Runtime.from_config(_config(tiny_llama, dp_size=2)) as rt:
        assert rt.engine.info["dp_size"] == 2
        params = {"max_new_tokens": 8, **GREEDY}
        # An idle engine alternates: a -> replica 0, b -> replica 1.
        first = rt.generate([a], params)[0]
        rt.generate([b], params)
        # b's prefix first: with no routing by prefix it would go to the least used replica (0).
        b2 = rt.generate(b + " again", params)
        a2 = rt.generate(a + " again", params)
        assert b2["meta_info"]["cached_tokens"] >= 32 and a2["meta_info"]["cached_tokens"] >= 32
        assert first["output_ids"] == hf_reference(rt.tokenizer.encode(a), 8)
        assert b2["output_ids"] == hf_reference(rt.tokenizer.encode(b + " again"), 8)
        stats = rt.get_stats()
        per_replica = stats.extra["replicas"]
        assert [r["extra"]["cached_tokens"] for r in per_replica] == [
            a2["meta_info"]["cached_tokens"],
            b2["meta_info"]["cached_tokens"],
        ]
        assert stats.extra["prompt_tokens"] == sum(r["extra"]["prompt_tokens"] for r in per_replica)
        # Concurrent unrelated requests spread over both replicas (least loaded), and all finish.
        before = [r["extra"]["prompt_tokens"] for r in per_replica]
        outs = rt.generate([f"request number {i}" for i in range(6)], params)
        assert all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
        after = [r["extra"]["prompt_tokens"] for r in rt.get_stats().extra["replicas"]]
        assert all(x > y for x, y in zip(after, before, strict=True))
        ok, message = rt.flush_cache()
        assert ok, message


def test_two_nodes_simulated_on_localhost(tiny_llama, hf_reference, tmp_path):
    """nnodes=2 with both "nodes" on this machine: node 1 is `rxf launch` with node_rank = 1 (its
    scheduler rank only), node 0 the Runtime (rank 0, router, detokenizer). Real multi-node runs
    differ only in the address."""
    addr = f"127.0.0.1:{free_port()}"
    node1 = tmp_path / "node1.toml"
    node1.write_text(
        f'[model]\npath = "{tiny_llama}"\n[runtime]\ndevice = "cpu"\ncpu_threads = 1\n'
        f'[attention]\nbackend = "torch_native"\n[cache]\nmax_total_tokens = 2048\n'
        f'[parallel]\ntp_size = 2\nnnodes = 2\nnode_rank = 1\ndist_init_addr = "{addr}"\n'
    )
    worker = subprocess.Popen([sys.executable, "-m", "rxf.entrypoints.cli", "launch", str(node1)])
    try:
        config = _config(tiny_llama, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr)
        with Runtime.from_config(config) as rt:
            assert [p.name for p in rt.engine.procs] == ["rxf-scheduler-dp0-tp0", "rxf-detokenizer"]
            out = rt.generate(PROMPTS[1], {"max_new_tokens": 16, **GREEDY})
            assert out["output_ids"] == hf_reference(rt.tokenizer.encode(PROMPTS[1]), 16)
            assert worker.poll() is None
    finally:
        worker.terminate()
        worker.wait(10)


def test_indivisible_heads_fail_start_up_with_the_reason(tiny_llama):
    with pytest.raises(EngineStartError, match="parallel.tp_size 3: the model's num_attention_heads 4 is not"):
        Runtime.from_config(_config(tiny_llama, tp_size=3))


def test_a_forward_failing_on_one_rank_ends_that_rank(tiny_llama, monkeypatch):
    """Alone, a failed forward fails its batch and the scheduler serves on; on a tensor-parallel
    rank it ends the process (its peers are stuck in a collective), so the engine reports dead."""
    from transformers import AutoTokenizer

    from rxf.core.config import load_config
    from rxf.core.ipc.messages import PreparedRequest
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.sampling_params import SamplingParams
    from rxf.core.scheduler import scheduler as scheduler_module

    config = load_config(_config(tiny_llama))
    runner = ModelRunner(config, PluginRegistry.load(), str(tiny_llama))
    sched = scheduler_module.Scheduler(config, runner, AutoTokenizer.from_pretrained(tiny_llama))

    def broken(inp):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runner, "forward_with_aux", broken)  # what the step executor calls
    params = SamplingParams.from_dict({"max_new_tokens": 4})
    sched.add_request(PreparedRequest("alone", [5, 6, 7], params))
    (out,) = sched.step()
    assert out.finished.type == "abort" and "illegal memory access" in out.finished.message
    monkeypatch.setattr(scheduler_module, "tp_size", lambda: 2)
    sched.add_request(PreparedRequest("rank", [5, 6, 7], params))
    with pytest.raises(SystemExit):
        sched.step()
