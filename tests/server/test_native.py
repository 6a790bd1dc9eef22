"""The native routes of the real server (a `rxf launch` subprocess), driven with httpx."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}


# Long enough that a request is still running when the test acts on it (it is then aborted).
LONG = 12000


@pytest.fixture(scope="module")
def server(module_server_factory, long_context_model_dir):
    """This module's own server, on the 16k-context model (see `long_context_model_dir`)."""
    return module_server_factory({"model.path": str(long_context_model_dir), "cache.max_total_tokens": 32768})


@pytest.fixture(scope="module")
def tokenizer(long_context_model_dir):
    return AutoTokenizer.from_pretrained(long_context_model_dir)


def generate(http: httpx.Client, **body: Any) -> Any:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """Parsed `data:` events of an SSE response; "[DONE]" is yielded as the string itself."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


def stream(http: httpx.Client, **body: Any) -> list[Any]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r))


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


def assert_serving(http: httpx.Client) -> None:
    out = generate(http, text="still alive?", sampling_params={"max_new_tokens": 2, **GREEDY})
    assert out["meta_info"]["completion_tokens"] == 2


def server_stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()["stats"]


def wait_idle(http: httpx.Client, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = server_stats(http)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["in_flight"] == 0:
            return stats
        assert time.monotonic() < deadline, f"requests still running: {stats}"
        time.sleep(0.1)


# ---- /generate ----
def test_generate_single(http, tokenizer):
    out = generate(http, text="The quick brown fox", sampling_params={"max_new_tokens": 12, **GREEDY})
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert len(out["output_ids"]) == 12
    assert out["text"] == tokenizer.decode(out["output_ids"])
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(tokenizer.encode("The quick brown fox"))
    assert meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length"}
    assert isinstance(meta["id"], str) and meta["cached_tokens"] >= 0


def test_generate_token_ids_equal_text(http, tokenizer):
    params = {"max_new_tokens": 8, **GREEDY}
    by_text = generate(http, text="token ids in", sampling_params=params)
    by_ids = generate(http, input_ids=tokenizer.encode("token ids in"), sampling_params=params)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["meta_info"]["prompt_tokens"] == by_text["meta_info"]["prompt_tokens"]


def test_generate_batch(http):
    prompts = ["a cat", "a much longer prompt about a dog", "你好"]
    outs = generate(http, text=prompts, sampling_params=[{"max_new_tokens": n, **GREEDY} for n in (2, 5, 3)])
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 5, 3]
    singles = [generate(http, text=p, sampling_params={"max_new_tokens": 5, **GREEDY}) for p in prompts]
    assert outs[1]["output_ids"] == singles[1]["output_ids"]
    ids_batch = generate(http, input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 3, **GREEDY},
                         rid=["batch-a", "batch-b"])
    assert [o["meta_info"]["id"] for o in ids_batch] == ["batch-a", "batch-b"]
    assert [o["meta_info"]["prompt_tokens"] for o in ids_batch] == [3, 2]


def test_stream_is_cumulative_and_joins_to_the_full_text(http):
    params = {"max_new_tokens": 16, **GREEDY}
    full = generate(http, text="streaming test", sampling_params=params)
    events = stream(http, text="streaming test", sampling_params=params)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]


def test_logprobs(http):
    body = {
        "text": "log probabilities", "sampling_params": {"max_new_tokens": 5, **GREEDY},
        "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0,
    }
    out = generate(http, **body)
    meta = out["meta_info"]
    assert [tid for _, tid in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _ in meta["output_token_logprobs"])
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    for (lp, tid), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert top[0][1] == tid and top[0][0] == pytest.approx(lp, abs=1e-4)
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    chunks = stream(http, **body)[:-1]
    final = chunks[-1]
    assert [tid for _, tid in final["meta_info"]["output_token_logprobs"]] == out["output_ids"]
    assert len(final["meta_info"]["output_top_logprobs"]) == 5
    # Cumulative chunks: each one's lists start with the previous one's, and the last one's are the
    # whole result's (the prompt's logprobs, sent once by the engine, are in every chunk from the first).
    for prev, cur in zip(chunks, chunks[1:], strict=False):
        for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
            assert cur["meta_info"][key][: len(prev["meta_info"][key])] == prev["meta_info"][key], key
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert _numbers(final["meta_info"][key]) == pytest.approx(_numbers(meta[key]), abs=1e-3, nan_ok=True), key


def _numbers(value) -> list:
    """The numbers of nested lists, flat (None as nan, equal to nan under nan_ok)."""
    if isinstance(value, list):
        return [x for item in value for x in _numbers(item)]
    return [float("nan") if value is None else value]


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"text": "x", "input_ids": [1]}, "text", "exactly one"),
        ({}, "text", "exactly one"),
        ({"text": 5}, "text", "valid string"),
        ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens", "in [0, "),
        ({"text": "x", "sampling_params": {"temperature": -1}}, None, "temperature"),
        ({"input_ids": [1, 100000]}, "input_ids", "[0, 512)"),
        ({"input_ids": []}, None, "empty"),
        ({"text": "x " * 20000}, None, "context length"),
        ({"text": ["a", "b"], "stream": True}, "stream", "batch"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "same length"),
        ({"text": ["a", "b"], "rid": "same"}, "rid", "list"),
        ({"text": []}, "text", "empty"),
        ({"text": "x", "top_logprobs_num": -2}, "top_logprobs_num", ""),
    ],
)
def test_generate_rejects_bad_requests(http, body, param, contains):
    assert_error(http.post("/generate", json=body), 400, param, contains)
    assert_serving(http)


def test_malformed_and_non_json_bodies(http):
    r = http.post("/generate", content=b'{"text": "x",', headers={"content-type": "application/json"})
    assert "malformed JSON" in assert_error(r, 400)["message"]
    r = http.post("/generate", content=b"", headers={"content-type": "application/json"})
    assert_error(r, 400, None, "missing")
    r = http.post("/generate", content=b"text=hello", headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(r, 400, None, "application/json")
    r = http.post("/generate", json=[1, 2])
    assert_error(r, 400)
    assert_serving(http)


def test_unknown_route_and_method(http):
    assert_error(http.get("/no/such/route"), 404, None, "no route GET /no/such/route")
    assert_error(http.get("/generate"), 405, None, "not allowed")
    assert_serving(http)


def test_a_running_rid_is_refused_before_a_stream_starts(http):
    with http.stream("POST", "/generate", json={"text": "x", "rid": "dup", "stream": True,
                                                 "sampling_params": {"max_new_tokens": LONG, **GREEDY}}) as r:
        events = sse_events(r)  # kept: a dropped generator closes the connection (a disconnect)
        assert next(events)["meta_info"]["id"] == "dup"
        again = {"text": "y", "rid": "dup", "sampling_params": {"max_new_tokens": 2}}
        assert_error(http.post("/generate", json={**again, "stream": True}), 400, "rid", "already running")
        assert_error(http.post("/generate", json=again), 400, "rid", "already running")
    twice = {"text": ["a", "b"], "rid": ["same", "same"], "sampling_params": {"max_new_tokens": 2}}
    assert_error(http.post("/generate", json=twice), 400, "rid", "already running")
    wait_idle(http)


def test_a_rid_reused_right_after_a_disconnect_gets_its_own_output(http):
    """The abandoned request's last outputs (its abort among them) are still in transit when the
    new one starts under its name; they must not reach it (they did, before submissions had ids of
    their own: the new request ended at once with the old one's tokens and "abort" finish)."""
    body = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 5, **GREEDY}}
    want = generate(http, **body, rid="reference")["output_ids"]
    for attempt in range(5):
        rid = f"reused-{attempt}"
        with http.stream("POST", "/generate", json={"text": "hello there", "rid": rid, "stream": True,
                                                     "sampling_params": {"max_new_tokens": LONG, **GREEDY}}) as r:
            events = sse_events(r)
            for _ in range(3):
                next(events)
        out = generate(http, **body, rid=rid)
        assert out["output_ids"] == want and out["meta_info"]["prompt_tokens"] == 3, out
    wait_idle(http)


# ---- health, info ----
def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = http.get("/health_generate")
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 1


def test_model_info(http, long_context_model_dir):
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(long_context_model_dir)
    assert info["architecture"] == "LlamaForCausalLM"
    assert (info["context_length"], info["vocab_size"]) == (16384, 512)
    assert (info["dtype"], info["device"]) == ("float32", "cpu")
    assert (info["is_generation"], info["pooling"]) == (True, None)  # an embedding model: test_embeddings.py
    assert info["served_model_name"]


def test_server_info(http):
    info = http.get("/get_server_info").json()
    assert info["config"]["cache"]["max_total_tokens"] == 32768
    assert info["config"]["runtime"]["cpu_threads"] == 1
    assert info["engine"]["max_total_tokens"] == 32768
    stats = info["stats"]
    for key in ("num_running", "num_waiting", "free_slots", "tree_slots", "total_slots", "cache_hit_rate"):
        assert key in stats
    assert stats["total_slots"] == 32768
    assert 0 <= stats["cache_hit_rate"] <= 1


# ---- cache, abort, disconnect ----
def test_flush_cache_refused_while_a_request_runs(http):
    body = {"text": "a long one", "stream": True, "sampling_params": {"max_new_tokens": LONG, **GREEDY}}
    with http.stream("POST", "/generate", json=body) as r:
        events = sse_events(r)  # kept: a dropped generator closes the connection (a disconnect)
        next(events)
        assert_error(http.post("/flush_cache"), 400, None, "in flight")
    wait_idle(http)
    r = http.post("/flush_cache")
    assert r.status_code == 200, r.text
    stats = server_stats(http)
    assert stats["free_slots"] == stats["total_slots"] and stats["tree_slots"] == 0


def test_profiling_is_refused_while_profile_dir_is_unset(http):
    assert_error(http.post("/start_profile", json={"num_steps": 4}), 400, None, "runtime.profile_dir")
    assert_error(http.post("/start_profile", json={"num_steps": 0}), 400, "num_steps")
    assert_error(http.post("/stop_profile"), 400, None, "runtime.profile_dir")


def test_abort_request(http):
    body = {"text": "abort me", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": LONG, **GREEDY}}
    with http.stream("POST", "/generate", json=body) as r:
        events = sse_events(r)
        next(events)
        assert http.post("/abort_request", json={"rid": "to-abort"}).json() == {"rid": "to-abort", "found": True}
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest[-2]["meta_info"]["completion_tokens"] < LONG
    assert http.post("/abort_request", json={"rid": "nobody"}).json()["found"] is False
    assert_error(http.post("/abort_request", json={}), 400, "rid")
    r = http.post("/abort_request", json={"rid": "r" * 100_000})  # longer than any running request's: not echoed
    assert_error(r, 400, "rid")
    assert len(r.content) < 2000
    wait_idle(http)


def test_disconnect_after_three_chunks_frees_the_request(http, server):
    body = {"text": "disconnect", "stream": True, "sampling_params": {"max_new_tokens": LONG, **GREEDY}}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as own:
        with own.stream("POST", "/generate", json=body) as r:
            events = sse_events(r)
            for _ in range(3):
                next(events)
        # leaving the block closed the connection mid-stream
    stats = wait_idle(http)
    assert stats["free_slots"] + stats["tree_slots"] == stats["total_slots"]
    assert_serving(http)


def test_non_stream_disconnect_aborts(http, server):
    before = scrape(http)
    body = {"text": "gone", "sampling_params": {"max_new_tokens": LONG, **GREEDY}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=0.3)
    stats = wait_idle(http)
    assert stats["free_slots"] + stats["tree_slots"] == stats["total_slots"]
    after = scrape(http)
    assert after["rxf:requests_total{finish_reason=abort}"] - before.get("rxf:requests_total{finish_reason=abort}", 0) == 1


# ---- metrics ----
def scrape(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name and labels (but `le`, and `model_name`, which each carries:
    the served model's id)."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    model = http.get("/v1/models").json()["data"][0]["id"]
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("model_name") == model, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("le", "model_name"))
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics(http):
    before = scrape(http)
    generate(http, text="metrics one", sampling_params={"max_new_tokens": 4, **GREEDY})
    stream(http, text="metrics two", sampling_params={"max_new_tokens": 6, **GREEDY})
    after = scrape(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("rxf:generation_tokens_total") == 10
    assert delta("rxf:prompt_tokens_total") >= 4
    assert delta("rxf:requests_total{finish_reason=length}") == 2
    assert delta("rxf:e2e_request_latency_seconds_count") == 2
    # Non-streaming requests too: the scheduler sends the time of their first token.
    assert delta("rxf:time_to_first_token_seconds_count") == 2
    assert delta("rxf:inter_token_latency_seconds_count") == 5
    assert 0 < delta("rxf:time_to_first_token_seconds_sum") < delta("rxf:e2e_request_latency_seconds_sum")
    assert after["rxf:num_running_reqs"] == 0 and after["rxf:num_queue_reqs"] == 0
    assert 0 <= after["rxf:token_usage"] <= 1
    assert 0 <= after["rxf:cache_hit_rate"] <= 1
    assert "rxf:cached_tokens_total" in after

    # vLLM's series: the same figures as rxf's where both have one, and the scheduler's phases of
    # each request, which add up to no more than its end-to-end latency.
    for rxf_name, vllm_name in [
        ("rxf:num_running_reqs", "vllm:num_requests_running"),
        ("rxf:num_queue_reqs", "vllm:num_requests_waiting"),
        ("rxf:token_usage", "vllm:kv_cache_usage_perc"),
        ("rxf:prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("rxf:prompt_tokens_total", "vllm:prefix_cache_queries_total"),
        ("rxf:cached_tokens_total", "vllm:prefix_cache_hits_total"),
        ("rxf:generation_tokens_total", "vllm:generation_tokens_total"),
        ("rxf:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
        ("rxf:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("rxf:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
        ("rxf:requests_total{finish_reason=length}", "vllm:request_success_total{finished_reason=length}"),
    ]:
        assert after[rxf_name] == after[vllm_name], (rxf_name, vllm_name)
    assert delta("vllm:request_success_total{finished_reason=length}") == 2
    assert delta("vllm:request_generation_tokens_sum") == 10 and delta("vllm:request_generation_tokens_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == delta("vllm:prompt_tokens_total") > 0
    phases = {p: delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode", "inference")}
    assert all(delta(f"vllm:request_{p}_time_seconds_count") == 2 for p in phases)
    assert all(v >= 0 for v in phases.values()) and phases["decode"] > 0 and phases["prefill"] > 0
    assert phases["prefill"] + phases["decode"] == pytest.approx(phases["inference"])
    assert phases["queue"] + phases["inference"] < delta("vllm:e2e_request_latency_seconds_sum")
    assert phases["prefill"] < delta("vllm:time_to_first_token_seconds_sum")
    # Per request, decode time / (tokens - 1): 3 and 5 gaps, so between decode/5 and decode/3.
    assert delta("vllm:request_time_per_output_token_seconds_count") == 2
    assert phases["decode"] / 5 <= delta("vllm:request_time_per_output_token_seconds_sum") <= phases["decode"] / 3
    assert "vllm:num_preemptions_total" in after
