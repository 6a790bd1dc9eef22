"""The `parallel` config section, rank placement, and the data-parallel router (no processes)."""

from __future__ import annotations

import pytest

from rxf.core.config import ConfigError, load_config
from rxf.core.frontend.dp_router import DpRouter, combine_results, combine_stats
from rxf.core.ipc.addresses import replica_addrs
from rxf.core.ipc.messages import AdminResult, SchedulerStats
from rxf.core.launch.processes import rank_placements


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"tp_size": 0}, "parallel.tp_size"),
        ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "node_rank 2 must be < nnodes 2"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "tp_size 3 must be a multiple of nnodes 2"),
        ({"nnodes": 2, "tp_size": 2}, "dist_init_addr"),
        ({"dist_init_addr": "node0"}, "must be host:port"),
        ({"dist_init_addr": "node0:99999"}, "must be host:port"),
        ({"dist_backend": "mpi"}, "parallel.dist_backend"),
    ],
)
def test_bad_parallel_settings_name_the_field(parallel, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"parallel": parallel})


def test_rank_placements_on_cpu():
    assert rank_placements(load_config({"runtime": {"device": "cpu"}})) == [None]
    config = load_config(
        {"runtime": {"device": "cpu"}, "parallel": {"tp_size": 4, "dp_size": 2, "nnodes": 2, "node_rank": 1,
                                                    "dist_init_addr": "10.0.0.1:29500"}}
    )
    placements = rank_placements(config)
    # Node 1 holds ranks 2 and 3 of each replica; replica d meets at port 29500 + d.
    assert [(p.dp_rank, p.rank, p.local_rank) for p in placements] == [(0, 2, 0), (0, 3, 1), (1, 2, 0), (1, 3, 1)]
    assert [p.init_method for p in placements] == ["tcp://10.0.0.1:29500"] * 2 + ["tcp://10.0.0.1:29501"] * 2
    assert {p.backend for p in placements} == {"gloo"} and not any(p.cuda for p in placements)
    assert [p.device_index for p in placements] == [0, 1, 2, 3]


def test_router_prefers_the_longest_cached_prefix_then_the_least_loaded():
    router = DpRouter(3, block_size=4)
    a, b = list(range(100, 120)), list(range(200, 212))
    assert router.route("a", a) == 0  # idle: fewest in flight, then fewest routed
    assert router.route("b", b) == 1
    assert router.route("c", [7, 8, 9]) == 2  # shorter than a block: no match, least loaded
    router.finished("a")
    assert router.route("a2", a[:9] + [1, 2, 3]) == 0  # two whole blocks cached on replica 0
    assert router.route("b2", b + [5]) == 1
    assert router.route("a3", a, salt="tenant") == 2  # another salt shares nothing: least loaded
    assert router.in_flight == [1, 2, 2] and router.route("x", [0] * 8) == 0
    router.forget_cache()
    assert router.matched_blocks(0, router._chain(a, None)) == 0
    assert router.replica_of("b2") == 1 and router.replica_of("a") is None


def test_router_index_is_bounded():
    router = DpRouter(2, block_size=2, max_blocks_per_replica=3)
    router.route("r", list(range(10)))  # 5 blocks; only the last 3 are kept
    assert router.matched_blocks(0, router._chain(list(range(10)), None)) == 0


def test_combine_replies():
    def stats(prompt, cached, running):
        return SchedulerStats(running, 0, 100, 50, 10, 5, 0.0, {"prompt_tokens": prompt, "cached_tokens": cached})

    total = combine_stats([stats(10, 5, 1), stats(30, 5, 2)])
    assert (total.num_running, total.total_slots, total.free_slots) == (3, 200, 100)
    assert total.cache_hit_rate == 10 / 40 and total.extra["prompt_tokens"] == 40
    assert [r["num_running"] for r in total.extra["replicas"]] == [1, 2]
    bad = combine_results([AdminResult(True, "cache flushed"), AdminResult(False, "busy")])
    assert not bad.ok and bad.message == "replica 1: busy"
    assert replica_addrs({"scheduler": "a", "scheduler_dp1": "b", "tokenizer": "t"}) == ["a", "b"]


def test_too_few_gpus_is_refused_before_start(monkeypatch):
    import torch

    from rxf.core.launch.processes import EngineStartError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = load_config({"runtime": {"device": "cuda"}, "parallel": {"tp_size": 2, "dp_size": 2}})
    with pytest.raises(EngineStartError, match="needs 4 GPUs on this node; torch sees 2"):
        rank_placements(config)
    placements = rank_placements(load_config({"runtime": {"device": "cuda"}, "parallel": {"tp_size": 2}}))
    assert [(p.backend, p.cuda, p.device_index) for p in placements] == [("nccl", True, 0), ("nccl", True, 1)]
