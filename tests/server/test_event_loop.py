"""Nothing one client sends holds the server's event loop: /health stays under 100 ms during a
million-id detokenize and a 10,000-message chat, and well under the time a 200k-message body takes
to validate; /get_server_info and /metrics answer at once while
the scheduler runs a long prefill (they read its pushed snapshot instead of waiting for the step).
Also, on this server of default visibility: the info routes show no paths and no IPC directory, and
an aborted OpenAI stream ends with finish_reason "abort"."""

from __future__ import annotations

import json
import threading
import time

import httpx
import msgspec
import pytest
from transformers import AutoTokenizer

from rxf.entrypoints.openai.protocol import ChatCompletionRequest, DetokenizeRequest
from rxf.testing.health_probe import HealthProbe

PREFILL_TOKENS = 8000  # one EXTEND step of seconds on the tiny model (attention is quadratic)


@pytest.fixture(scope="module")
def server(module_server_factory, long_context_model_dir):
    return module_server_factory({
        "model.path": str(long_context_model_dir), "cache.max_total_tokens": 65536,
        "scheduler.max_prefill_tokens": 8192, "server.expose_internals": False,
        "model.served_model_name": "tiny",  # the model id defaults to model.path, which /v1/models shows
    })


@pytest.fixture(scope="module")
def tokenizer(long_context_model_dir):
    return AutoTokenizer.from_pretrained(long_context_model_dir)


def _idle_health_s(server) -> float:
    """/health's slowest answer over half a second with nothing else sent (what the machine's own
    load adds to every answer)."""
    with HealthProbe(server.url) as idle:
        time.sleep(0.5)
    return idle.max_latency_s()


def _stall_within_bound(server, body: str, request_type: type, send, attempts: int = 3) -> list[str]:
    """Post `body` (through `send`) while /health is probed, up to `attempts` times, until /health's
    slowest answer is within the bound; returns one line per attempt, the passing one last, or
    fails. The event loop's own hold on a body shows in every attempt; one on which the 2-core
    machine did not schedule the server's process for a while (a full test session runs beside it)
    does not, so a stall is the server's only if it repeats."""
    seen = []
    for _ in range(attempts):
        bound = _stall_bound_s(server, body, request_type)
        with HealthProbe(server.url) as probe:
            send()
        seen.append(f"/health max {probe.max_latency_s() * 1000:.1f} ms over {len(probe.probes)} probes "
                    f"(bound {bound * 1000:.1f} ms)")
        if probe.max_latency_s() < bound:
            return seen
    pytest.fail("/health waited past the bound in every attempt: " + "; ".join(seen))


def _stall_bound_s(server, body: str, request_type: type) -> float:
    """How long /health may wait behind `body`: the event loop must decode and validate it (the
    rest is off the loop), so the bound is 100 ms or three times what that takes here and now,
    whichever is longer (on a 2-core machine that also runs the rest of a test session the work
    takes several times its quiet ~30 ms), plus /health's idle latency."""
    start = time.perf_counter()
    request_type.model_validate(msgspec.json.decode(body))
    return max(0.1, 3 * (time.perf_counter() - start)) + _idle_health_s(server)


def test_health_stays_fast_during_a_million_id_detokenize(server, http, model, tokenizer):
    # Encoded before the probe starts: encoding 3 MB of JSON holds this process's GIL, which the
    # probe's thread needs to send and time its requests (that stall would be the client's own).
    body = json.dumps({"model": model, "tokens": [7] * 1_000_000})
    answers = []

    def send() -> None:
        r = http.post("/v1/detokenize", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        assert "context length" in r.json()["error"]["message"]
        answers.append(r.elapsed.total_seconds())

    seen = _stall_within_bound(server, body, DetokenizeRequest, send)
    print(f"\n1M-id detokenize: answered in {answers[-1] * 1000:.0f} ms; " + "; ".join(seen))
    ids = [3 + i % 500 for i in range(3000)]  # within the context: decoded as the tokenizer decodes
    r = http.post("/v1/detokenize", json={"model": model, "tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode(ids)


def test_health_stays_fast_during_a_10k_message_chat(server, http, model):
    messages = [{"role": "user", "content": f"message {i}"} for i in range(10_000)]
    chat_body = json.dumps({"model": model, "messages": messages, "max_tokens": 1})  # (encoded first: see above)
    tokenize_body = json.dumps({"model": model, "messages": messages})
    headers = {"Content-Type": "application/json"}
    answers = []

    def send() -> None:
        chat = http.post("/v1/chat/completions", content=chat_body, headers=headers)
        tokenized = http.post("/v1/tokenize", content=tokenize_body, headers=headers)
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
        assert tokenized.status_code == 200 and tokenized.json()["count"] > 16384
        answers.append((chat.elapsed.total_seconds(), tokenized.elapsed.total_seconds()))

    seen = _stall_within_bound(server, chat_body, ChatCompletionRequest, send)
    print(f"\n10k-message chat and tokenize: {answers[-1][0]:.2f} s, {answers[-1][1]:.2f} s; " + "; ".join(seen))


def test_a_large_body_is_validated_off_the_event_loop(server, http, model):
    """200k messages (5.8 MB): validating them takes over a second here, which every other client
    waited for while it ran on the event loop (a hostile-input audit, 2026-12-07). In a worker thread
    /health waits at most a quarter of that (the thread holds the GIL between switches)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": ""}] * 200_000, "max_tokens": 1})
    start = time.perf_counter()
    ChatCompletionRequest.model_validate(msgspec.json.decode(body))
    on_loop_s = time.perf_counter() - start
    seen = []
    for _ in range(3):  # as `_stall_within_bound`: a stall is the server's only if it repeats
        bound = max(0.25, on_loop_s / 4) + _idle_health_s(server)
        with HealthProbe(server.url) as probe:
            r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
        seen.append(f"/health max {probe.max_latency_s() * 1000:.0f} ms (bound {bound * 1000:.0f} ms)")
        if probe.max_latency_s() < bound:
            break
    else:
        pytest.fail(f"validation on the loop takes {on_loop_s:.2f} s here; " + "; ".join(seen))
    print(f"\n200k messages: validated on the loop in {on_loop_s:.2f} s here; " + "; ".join(seen))
    # a large invalid body gets the 400 a small one gets (FastAPI's own errors, raised from the thread)
    for n in (1, 2000):
        bad = {"model": model, "messages": [{"role": "user", "content": ""}] * n + [{"role": "user", "content": 5}]}
        r = http.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[{n}].content", r.text[:300]


def test_monitoring_answers_at_once_during_a_long_prefill(server, http):
    done = threading.Event()

    def long_prefill() -> None:
        body = {"input_ids": [3 + i % 500 for i in range(PREFILL_TOKENS)], "sampling_params": {"max_new_tokens": 1}}
        httpx.post(f"{server.url}/generate", json=body, timeout=300)
        done.set()

    thread = threading.Thread(target=long_prefill)
    thread.start()
    while http.get("/get_server_info").json()["stats"]["in_flight"] == 0:
        time.sleep(0.01)
    times: dict[str, list[float]] = {"/get_server_info": [], "/metrics": []}
    ages = []
    while not done.is_set() and len(times["/metrics"]) < 20:
        for path, seen in times.items():
            start = time.perf_counter()
            r = http.get(path)
            seen.append(time.perf_counter() - start)
            assert r.status_code == 200
            if path == "/get_server_info":
                ages.append(r.json()["stats_age_s"])
        time.sleep(0.05)
    thread.join(300)
    worst = {path: round(max(seen) * 1000, 1) for path, seen in times.items() if seen}
    print(f"\nduring a {PREFILL_TOKENS}-token prefill: slowest answers (ms) {worst}; snapshot age up to {max(ages):.2f} s")
    assert times["/metrics"], "the prefill ended before monitoring could be measured"
    # An answer that waited for the step would wait seconds (the prefill is one step); on a 2-core
    # machine whose cores the step's threads take, the OS left the server unscheduled for up to
    # ~240 ms now and then (once in a few runs), so one slow answer is not the server's: most answer
    # within 100 ms, none waits a second.
    for path, seen in times.items():
        assert sorted(seen)[len(seen) // 2] < 0.1 and max(seen) < 1.0, (path, worst)
    stats = http.get("/get_server_info").json()["stats"]  # once idle, the snapshot is exact
    assert stats["in_flight"] == stats["num_running"] == 0
    assert stats["free_slots"] + stats["tree_slots"] == stats["total_slots"]


def test_info_routes_show_no_paths_by_default(http, long_context_model_dir):
    model_info = http.get("/get_model_info").json()
    assert model_info["context_length"] == 16384 and "model_path" not in model_info
    info = http.get("/get_server_info").json()
    assert "ipc_dir" not in info["engine"] and "model_path" not in info["engine"]
    assert set(info["config"]) == {"scheduler", "cache", "grammar"}
    assert info["engine"]["max_context_len"] == 16384 and "free_slots" in info["stats"]
    for body in (model_info, info):
        text = json.dumps(body)
        assert str(long_context_model_dir) not in text and "rxf-ipc-" not in text


def test_an_aborted_openai_stream_ends_with_finish_reason_abort(http, client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=10000, stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:  # the choice's request is `<id>-<index>`
            assert http.post("/abort_request", json={"rid": f"{chunk.id}-0"}).json()["found"]
    assert chunks[-1].choices[0].finish_reason == "abort"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert sum(len(c.choices[0].delta.content or "") for c in chunks) > 0
