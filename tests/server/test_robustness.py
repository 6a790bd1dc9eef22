"""Malformed and adversarial clients against the demo server: each bad request is a 400 naming the
field (or a correct answer), leaves no request in flight and no KV slot held outside the tree, and
changes nothing for the other clients (their greedy outputs equal the ones they get alone)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from rxf.core.frontend.requests import GenerateRequest
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.testing import make_tiny_tokenizer

SURROGATE = "\ud800"  # a lone UTF-16 surrogate: JSON can escape it, UTF-8 cannot encode it
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


def post_raw(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` as ASCII JSON: a lone surrogate travels as its `\\ud800` escape."""
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def assert_400(r: httpx.Response, param: str | None, *words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error


def assert_clean(http: httpx.Client, timeout: float = 10.0) -> None:
    """Nothing in flight, every KV slot free or in the radix tree, and a generation goes through."""
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/get_server_info").json()["stats"]
        if stats["num_running"] == stats["num_waiting"] == stats["in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"requests still in flight: {stats}"
        time.sleep(0.05)
    assert stats["free_slots"] + stats["tree_slots"] == stats["total_slots"], stats
    assert http.get("/health_generate").status_code == 200


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SURROGATE_CASES = [
    ("/v1/completions", {"prompt": "a" + SURROGATE}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", SURROGATE], "stream": True}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": SURROGATE}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "stop": [SURROGATE]}, "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "regex": SURROGATE}, "regex"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}],
                              "stream": True}, "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "model": SURROGATE}, "model"),
    ("/generate", {"text": SURROGATE, "stream": True}, "text"),
    ("/generate", {"text": "hi", "cache_salt": SURROGATE}, "cache_salt"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": SURROGATE}}, "sampling_params.stop"),
    ("/abort_request", {"rid": SURROGATE}, "rid"),
    ("/v1/tokenize", {"prompt": SURROGATE}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES, ids=[c[2] for c in SURROGATE_CASES])
def test_lone_surrogates_are_400_naming_the_field(http, model, path, body, param):
    body = {"model": model, **body} if path.startswith("/v1") and "model" not in body else body
    assert_400(post_raw(http, path, body), param, "surrogate")


def test_native_fields_are_strictly_typed(http):
    for field, value in [("stream", "yes"), ("return_logprob", 1), ("top_logprobs_num", "5"), ("rid", 7)]:
        assert_400(post_raw(http, "/generate", {"text": "hi", field: value}), field)
    assert_400(post_raw(http, "/generate", {"input_ids": [1.0, 2]}), "input_ids")
    assert_clean(http)


@pytest.mark.parametrize("key", [" 7 ", "1_0", "\u0663", "7.0"])
def test_logit_bias_keys_are_decimal_token_ids(http, model, key):
    assert_400(post_raw(http, "/v1/completions", {"model": model, "prompt": "hi", "logit_bias": {key: 1}}),
               "logit_bias", "token ids")
    assert_400(post_raw(http, "/generate", {"text": "hi", "sampling_params": {"logit_bias": {key: 1}}}),
               "sampling_params.logit_bias", "token ids")


def test_unreadable_bodies_say_why(http):
    json_type = {"content-type": "application/json"}
    r = http.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=json_type)
    assert_400(r, None, "not valid UTF-8")
    r = http.post("/generate", content=b"[" * 100_000 + b"]" * 100_000, headers=json_type)
    assert_400(r, None, "too deeply")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "word " * 1_000_000}, "text"),
        ("/v1/completions", {"prompt": ["ok", "word " * 1_000_000]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1_000_000}]}, "messages"),
    ],
)
def test_text_too_long_for_the_context_is_refused_untokenized(http, model, path, body, param):
    body = {"model": model, **body} if path.startswith("/v1") else body
    assert_400(post_raw(http, path, body), param, "characters cannot fit")


def _stream_until(server, body: dict[str, Any], started: threading.Event, stop: threading.Event) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as own, own.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.set()
            if stop.is_set():
                return  # leaving closes the connection mid-stream: the request is aborted


def _hog(http: httpx.Client) -> dict[str, Any]:
    """A stream asking for the whole context (the largest max_new_tokens accepted)."""
    context = http.get("/get_model_info").json()["context_length"]
    room = context - len(http.post("/v1/tokenize", json={"prompt": "hog"}).json()["tokens"])
    return {"text": "hog", "stream": True, "sampling_params": {"max_new_tokens": room, **GREEDY}}


def test_a_huge_max_new_tokens_does_not_block_other_clients(server, http, client, model):
    ask = {"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    alone = client.completions.create(**ask).choices[0].text
    started, stop = threading.Event(), threading.Event()
    hog = _hog(http)
    thread = threading.Thread(target=_stream_until, args=(server, hog, started, stop))
    thread.start()
    try:
        assert started.wait(30)
        # Admission once counted the hog's whole budget as future KV: nothing else was admitted.
        assert client.with_options(timeout=20).completions.create(**ask).choices[0].text == alone
    finally:
        stop.set()
        thread.join()
    assert_clean(http)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_aborts(server, http, model, path):
    body = {"model": model, "max_tokens": 4000, "n": 2, **GREEDY}
    body |= {"prompt": "gone"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "gone"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}{path}", json=body, timeout=1.0)
    assert_clean(http, timeout=5)  # 4000 tokens would take minutes: only an abort ends it this soon


def test_disconnect_storm_leaks_nothing(server, http, model):
    bodies = [
        ("/generate", {"text": "storm", "stream": True, "sampling_params": {"max_new_tokens": 2000, **GREEDY}}),
        ("/v1/completions", {"model": model, "prompt": "storm", "stream": True, "max_tokens": 2000, "n": 3, **GREEDY}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "storm"}],
                                  "stream": True, "max_tokens": 2000, "n": 2, **GREEDY}),
    ]

    async def one(ac: httpx.AsyncClient, path: str, body: dict[str, Any]) -> int:
        async with ac.stream("POST", path, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return r.status_code  # gone after the first event
        return r.status_code

    async def storm() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, *bodies[i % 3]) for i in range(24)))

    assert set(asyncio.run(storm())) == {200}
    assert_clean(http)


BAD_NEIGHBOURS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": [[1, 2], [10**9]]}),
    ("/v1/completions", {"prompt": "y", "max_tokens": 10**9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1_000_000}]}),
    ("/generate", {"text": ["fine", "x"], "sampling_params": [{"max_new_tokens": 2}, {"top_p": 0}]}),
    ("/generate", {"text": "z", "sampling_params": {"logit_bias": {"nope": 1}}}),
]


def test_bad_neighbours_do_not_change_greedy_outputs(server, http, client, model):
    prompts = ["The capital of France is", "Water boils at", "def fib(n):", "One, two, three,"]

    def good(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    def bad(path: str, body: dict[str, Any]) -> int:
        body = {"model": model, **body} if path.startswith("/v1") else body
        with httpx.Client(base_url=server.url, timeout=60) as own:
            return post_raw(own, path, body).status_code

    alone = [good(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts) + len(BAD_NEIGHBOURS)) as pool:
        bad_futures = [pool.submit(bad, path, body) for path, body in BAD_NEIGHBOURS]
        good_futures = [pool.submit(good, p) for p in prompts]
        hog_stop, hog_started = threading.Event(), threading.Event()
        hog = _hog(http)
        hog_future = pool.submit(_stream_until, server, hog, hog_started, hog_stop)
        together = [f.result() for f in good_futures]
        hog_stop.set()
        hog_future.result()
        assert [f.result() for f in bad_futures] == [400] * len(BAD_NEIGHBOURS)
    assert together == alone
    assert_clean(http)


def test_a_routing_failure_leaves_nothing_in_flight(tmp_path: Path):
    """Whatever fails once a request is registered must unregister it (it would otherwise count
    against max_in_flight for good): routing fails here, before anything is sent."""
    tokenizer = make_tiny_tokenizer(64)
    addrs = {"scheduler": f"ipc://{tmp_path}/scheduler", "tokenizer": f"ipc://{tmp_path}/tokenizer"}
    tm = TokenizerManager(tokenizer, addrs, {"max_context_len": 32, "vocab_size": 64})

    def fail(*_: Any) -> int:
        raise UnicodeEncodeError("utf-8", SURROGATE, 0, 1, "surrogates not allowed")

    tm.router.route = fail  # type: ignore[method-assign]

    async def run() -> None:
        with pytest.raises(UnicodeEncodeError):
            async for _ in tm.generate(tm.preparer.prepare(GenerateRequest(input_ids=[1, 2, 3], rid="r"))):
                pass

    try:
        asyncio.run(run())
        assert tm.states == {} and tm.router.in_flight == [0]
    finally:
        asyncio.run(tm.close())


def test_tokenizing_megabytes_does_not_stall_other_requests(server, http, model):
    """/v1/tokenize has no context bound, so a 7 MB prompt is tokenized (seconds): off the event loop."""
    done = threading.Event()

    def tokenize() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as own:
            r = own.post("/v1/tokenize", json={"model": model, "prompt": "word " * 1_400_000})
        assert r.status_code == 200 and r.json()["count"] > 1_000_000, r.text[:200]
        done.set()

    thread = threading.Thread(target=tokenize)
    thread.start()
    latencies = []
    while not done.is_set() and thread.is_alive():
        start = time.monotonic()
        assert http.get("/health").status_code == 200
        latencies.append(time.monotonic() - start)
    thread.join()
    assert done.is_set() and len(latencies) > 3 and max(latencies) < 1.0, latencies
