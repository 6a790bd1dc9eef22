"""Health and shutdown: /health turns 503 within 100 ms of a child's death; on SIGTERM the server
keeps its listener open for the drain and answers every new request 503 + Retry-After (no
connection refused) while the requests in flight run on, then aborts them: a native stream ends
with finish_reason "abort", an OpenAI one with a chunk whose finish_reason is "abort", and an
unstreamed OpenAI request answers what it has with finish_reason "abort"."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from rxf.entrypoints.http_server import DRAIN_S
from rxf.testing.health_probe import HealthProbe

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 15000, "ignore_eos": True}


def test_health_turns_503_within_100_ms_of_a_childs_death(server_factory):
    srv = server_factory({"server.exit_on_engine_death": False})
    scheduler = next(p for p in srv.children if "rxf-scheduler" in " ".join(p.cmdline()))
    with HealthProbe(srv.url, interval_s=0.01) as probe:
        time.sleep(0.1)
        killed = time.monotonic()
        scheduler.send_signal(signal.SIGKILL)
        deadline = killed + 5
        while probe.first_answer(503) is None:
            assert time.monotonic() < deadline, "no 503 within 5 s"
            time.sleep(0.01)
    first = probe.first_answer(503)
    noticed = first.sent + first.latency_s - killed
    print(f"\n/health answered 503 {noticed * 1000:.0f} ms after the scheduler's SIGKILL")
    assert all(p.status == 200 for p in probe.probes if p.sent + p.latency_s < killed)
    assert noticed < 0.1
    assert all(p.status == 503 for p in probe.probes if p.sent > first.sent)


def _native_stream(url: str, started: threading.Event, events: list[str]) -> None:
    body = {"text": "x", "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()


def _openai_stream(base_url: str, model: str, started: threading.Event, finishes: list) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model=model, prompt="x", max_tokens=15000, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        finishes.append(chunk.choices[0].finish_reason)
        started.set()


def _openai_unary(base_url: str, model: str, out: list) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    out.append(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=15000, extra_body={"ignore_eos": True}))


def test_sigterm_drains_with_503_and_retry_after_then_aborts_the_streams(server_factory, long_context_model_dir):
    srv = server_factory({"model.path": str(long_context_model_dir), "cache.max_total_tokens": 65536})
    model = str(long_context_model_dir)
    native: list[str] = []
    finishes: list = []
    unary: list = []
    started = [threading.Event(), threading.Event()]
    readers = [
        threading.Thread(target=_native_stream, args=(srv.url, started[0], native)),
        threading.Thread(target=_openai_stream, args=(srv.base_url, model, started[1], finishes)),
        threading.Thread(target=_openai_unary, args=(srv.base_url, model, unary)),
    ]
    for reader in readers:
        reader.start()
    assert all(s.wait(30) for s in started)
    while httpx.get(f"{srv.url}/get_server_info").json()["stats"]["in_flight"] < 3:
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    answers, metrics = [], []
    while time.monotonic() - signalled < DRAIN_S - 0.5:  # new clients, each on a new connection
        for method, path, body in (("POST", "/generate", {"text": "late"}), ("GET", "/health", None),
                                   ("GET", "/v1/models", None)):
            r = httpx.request(method, f"{srv.url}{path}", json=body, timeout=5)
            answers.append((path, r.status_code, r.headers.get("retry-after"), r.headers.get("connection")))
        metrics.append(httpx.get(f"{srv.url}/metrics", timeout=5).status_code)  # monitoring sees the drain
        time.sleep(0.1)
    assert all(s.is_alive() for s in readers), "the streams must run on during the drain"
    code = srv.proc.wait(20)
    server_factory.started.remove(srv)
    for reader in readers:
        reader.join(10)
    print(f"\nSIGTERM drain: {len(answers)} new requests over {DRAIN_S - 0.5:.1f} s, statuses "
          f"{sorted({a[1] for a in answers})}; exit code {code}")
    assert {(a[1], a[2], a[3]) for a in answers} == {(503, "1", "close")}, answers
    assert set(metrics) == {200}
    assert native[-1] == "[DONE]" and json.loads(native[-2])["meta_info"]["finish_reason"]["type"] == "abort"
    assert finishes[-1] == "abort" and all(f is None for f in finishes[:-1])
    assert unary[0].choices[0].finish_reason == "abort" and unary[0].usage.completion_tokens > 0
    survivors = [p for p in srv.children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert code == 0 and not survivors and not os.path.exists(srv.ipc_dir), (code, survivors)
