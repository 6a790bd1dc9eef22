"""(1) 200 concurrent streaming requests all complete; (2) 30% of clients hanging up at random
points leave nothing running and no slot leaked; (3) a short chaos run (normal, hostile, slow and
disconnecting clients) leaves every client answered as it should be and nothing held. Figures are
printed (-s).

The tiny checkpoint, not the demo model: on this 2-core CPU the demo model (SmolLM2-135M, fp32,
torch_native attention) needs minutes for 200 concurrent requests, over this folder's time budget.
`benchmarks/soak.py` runs the same load against the demo model (its figures are in the notes).
The small KV pool (4096 slots) makes later requests wait for KV while the first ones run."""

from __future__ import annotations

import asyncio

import pytest

from rxf.testing.chaos import run_chaos
from rxf.testing.soak import run_soak

pytestmark = pytest.mark.slow

READ_TIMEOUT_S = 2.0  # short, so the chaos run's slow clients are cut within it


@pytest.fixture(scope="module")
def load_server(module_server_factory):
    return module_server_factory({
        "scheduler.max_running_requests": 64,
        "server.header_timeout_s": READ_TIMEOUT_S, "server.body_timeout_s": READ_TIMEOUT_S,
    })


def test_200_concurrent_streams_all_complete(load_server):
    result = asyncio.run(run_soak(load_server.url, requests=200, concurrency=200, max_tokens=8, request_timeout_s=120))
    print("\nsoak (200 streams, tiny model):", result.summary())
    assert result.completed == 200 and result.errors == 0 and result.hung == 0, result.summary()
    assert result.running_after == 0
    assert result.leaked_before_flush == 0  # free + tree == total with nothing running
    assert result.slots_leaked == 0  # all free after /flush_cache


def test_30_percent_disconnects_leak_nothing(load_server):
    result = asyncio.run(
        run_soak(load_server.url, requests=200, concurrency=200, max_tokens=12, disconnect_fraction=0.3, seed=1)
    )
    print("\nsoak (200 streams, 30% hang up, tiny model):", result.summary())
    assert result.disconnected > 20 and result.errors == 0 and result.hung == 0, result.summary()
    assert result.completed + result.disconnected == 200
    assert result.running_after == 0 and result.leaked_before_flush == 0 and result.slots_leaked == 0


def test_chaos_leaves_every_client_answered_and_nothing_held(load_server):
    result = asyncio.run(run_chaos(load_server.url, duration_s=8, server_pid=load_server.proc.pid, seed=2))
    summary = result.summary()
    print("\nchaos (8 s, tiny model):", summary)
    assert not result.errors, summary
    assert all(result.served[kind] > 0 for kind in ("normal", "hostile", "slow_header", "slow_body", "disconnecting"))
    low, high = summary["slow_clients_cut_after_s"]["slow_header"]
    assert 0.8 * READ_TIMEOUT_S <= low and high < READ_TIMEOUT_S + 1.5, summary  # (measured by a busy client)
    assert not result.health_failures and summary["health_ms"]["n"] > 50
    assert result.running_after == 0 and result.leaked_before_flush == 0 and result.slots_leaked == 0
    assert {"server", "rxf-scheduler", "rxf-detokenizer"} <= set(result.rss_mib)
