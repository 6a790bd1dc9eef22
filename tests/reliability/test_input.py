"""Hostile and oversized input against one tiny server with an API key: (3) a hypothesis fuzz of
the OpenAI bodies (completions, chat, responses) never gets a 5xx; a schemathesis fuzz of every
route from the server's own OpenAPI document gets no 5xx and only responses the document describes;
(6) every route but /health needs the key; the body size limit; the per-field limits; cache_salt
isolation."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi import checks as openapi_checks

from rxf.core.config import load_config
from rxf.entrypoints.http_server import create_app

KEY = "fuzz-key"
MAX_BODY = 64 * 1024
MODEL = "tiny"


@pytest.fixture(scope="module")
def srv(module_server_factory):
    return module_server_factory(
        {"server.max_body_bytes": MAX_BODY, "model.served_model_name": MODEL, "scheduler.max_running_requests": 8},
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def http(srv):
    with srv.client(timeout=30) as client:
        yield client


def _normal_request_works(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---- (3) fuzz ----
_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.lists(st.integers(-5, 300_000), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


# In-range values, so that the request gets past validation into the engine...
_VALID_COMMON = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(0, 12),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "seed": st.integers(0, 2**63 - 10),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=5),
    "stream": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "cache_salt": st.text(min_size=1, max_size=8),
    "unknown_field": _junk,
}
_VALID_COMPLETION = _VALID_COMMON | {
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 255), min_size=1, max_size=8)),
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
}
_VALID_CHAT = _VALID_COMMON | {
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}),
        min_size=1, max_size=3,
    ),
    "logprobs": st.booleans(),
    "max_completion_tokens": st.integers(0, 12),
}
# ...and anything at all, wrong types and out-of-range values included.
_WIDE_COMMON = {
    "max_tokens": st.one_of(st.integers(-5, 24), st.integers(100, 10**6), st.text(max_size=3), st.booleans()),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "n": st.integers(-2, 130),
    "stop": st.lists(st.text(max_size=4), max_size=20), "seed": st.integers(-5, 2**64),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 300_000).map(str), st.text(max_size=3)),
                                  st.floats(-200, 200), max_size=5),
    "stop_token_ids": st.lists(st.integers(-5, 300_000), max_size=3), "cache_salt": st.text(max_size=300),
}
_WIDE_COMPLETION = _WIDE_COMMON | {
    "prompt": st.one_of(st.lists(st.integers(-3, 300_000), max_size=8), st.lists(st.text(max_size=10), max_size=3)),
    "logprobs": st.integers(-2, 25),
}
_WIDE_CHAT = _WIDE_COMMON | {
    "messages": st.lists(st.fixed_dictionaries({"role": st.text(max_size=6), "content": _junk}), max_size=3),
    "top_logprobs": st.integers(-2, 25),
}


def _body(fields: dict[str, st.SearchStrategy], required: tuple[str, ...]) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {k: v for k, v in fields.items() if k in required},
        optional={k: v for k, v in fields.items() if k not in required},
    )


def _bodies(valid: dict[str, st.SearchStrategy], wide: dict[str, st.SearchStrategy], required: tuple[str, ...]):
    """Half the bodies in range; the others with each field also drawn wide or as junk."""
    hostile = {k: st.one_of(v, wide.get(k, v), _junk) for k, v in valid.items()} | {
        k: st.one_of(v, _junk) for k, v in wide.items() if k not in valid
    }
    return st.one_of(_body(valid, required), _body(hostile, required))


def _check(http: httpx.Client, path: str, body: dict, seen: list[int]) -> None:
    # NaN and Infinity literals too: Python's JSON parser (and so the server's) accepts them.
    r = http.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    seen.append(r.status_code)
    if r.status_code == 200 and body.get("stream") is True:  # errors after the headers: as events
        for line in r.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line.removeprefix("data: "))["error"]
                assert error["type"] != "server_error" and not str(error["code"]).startswith("5"), (body, line)


def _report(path: str, seen: list[int]) -> None:
    counts = {code: seen.count(code) for code in sorted(set(seen))}
    print(f"\nfuzz {path}: {len(seen)} cases, statuses {counts}")
    assert len(seen) >= 250 and 200 in counts  # enough cases, and some got past validation


FUZZ_OPENAPI_EXAMPLES = 600
_FUZZ = settings(max_examples=260, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def test_fuzz_completions(http):
    seen: list[int] = []

    @_FUZZ
    @given(_bodies(_VALID_COMPLETION, _WIDE_COMPLETION, ("model", "prompt")))
    def run(body: dict) -> None:
        _check(http, "/v1/completions", body, seen)

    run()
    _report("/v1/completions", seen)
    _normal_request_works(http)


def test_fuzz_chat_completions(http):
    seen: list[int] = []

    @_FUZZ
    # max_tokens always: chat's default budget is the whole context, slow on this model.
    @given(_bodies(_VALID_CHAT, _WIDE_CHAT, ("model", "messages", "max_tokens")))
    def run(body: dict) -> None:
        _check(http, "/v1/chat/completions", body, seen)

    run()
    _report("/v1/chat/completions", seen)
    _normal_request_works(http)


_TEXT = st.text(max_size=20)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": st.sampled_from(["data:,", "x", "data:image/png;base64,AA"])}),
    st.dictionaries(st.sampled_from(["type", "text", "refusal"]), _junk, max_size=2),
)
_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": st.one_of(_TEXT, st.lists(_PART, max_size=3))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": _TEXT, "name": st.sampled_from(["f", "g h"]),
                           "arguments": st.sampled_from(["{}", '{"a": 1}', "[1]", "{", ""])}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _TEXT,
                           "output": st.one_of(_TEXT, st.lists(_PART, max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "message"])}),
    _junk,
)
_TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]), "name": st.sampled_from(["f", "g", ""]),
                               "parameters": st.sampled_from([{"type": "object"}, {"type": "object", "properties": 5}, {}])})
_VALID_RESPONSES = {
    "model": st.just(MODEL),
    "input": st.one_of(st.text(min_size=1, max_size=30), st.lists(_ITEM, min_size=1, max_size=4)),
    "instructions": _TEXT,
    "max_output_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "tools": st.lists(_TOOL, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "x"])})),
    "text": st.fixed_dictionaries({"format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "name": st.just("s"),
                               "schema": st.sampled_from([{"type": "object"}, {"type": "integer"}, {"type": 7}])}))}),
    "top_logprobs": st.integers(0, 3),
    "previous_response_id": st.sampled_from(["resp_missing", ""]),
    "store": st.booleans(),
    "stream": st.booleans(),
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=5), max_size=17),
    "unknown_field": _junk,
}
_WIDE_RESPONSES = {"max_output_tokens": _WIDE_COMMON["max_tokens"], "temperature": st.floats(-1, 3),
                   "top_logprobs": st.integers(-2, 25)}


def test_fuzz_responses(http):
    seen: list[int] = []

    @settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    # max_output_tokens always: left out, the budget is the whole context, slow on this model.
    @given(_bodies(_VALID_RESPONSES, _WIDE_RESPONSES, ("model", "input", "max_output_tokens")))
    def run(body: dict) -> None:
        r = http.post("/v1/responses", content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text)
        seen.append(r.status_code)
        if r.status_code == 200 and body.get("stream") is True:  # a failure after the headers: response.failed
            ended = "event: response.completed" in r.text or "event: response.incomplete" in r.text
            assert ended and "event: response.failed" not in r.text, (body, r.text[-500:])

    run()
    counts = {code: seen.count(code) for code in sorted(set(seen))}
    print(f"\nfuzz /v1/responses: {len(seen)} cases, statuses {counts}")
    assert len(seen) >= 150 and 200 in counts and 400 in counts
    _normal_request_works(http)


_TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
_BLOCK = st.one_of(
    _TEXT_BLOCK,
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=6), "name": st.sampled_from(["f", "g"]),
                           "input": st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=6),
                           "content": st.one_of(st.text(max_size=10), st.lists(_TEXT_BLOCK, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("image"), "source": st.fixed_dictionaries(
        {"type": st.just("base64"), "media_type": st.just("image/png"), "data": st.text(max_size=8)})}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.text(max_size=10)}),
)
_VALID_MESSAGES = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 12),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.one_of(st.text(max_size=30), st.lists(_BLOCK, max_size=3)),
    }), min_size=1, max_size=3),
    "system": st.one_of(st.text(max_size=20), st.lists(_TEXT_BLOCK, max_size=2)),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "stream": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"]),
                                             "input_schema": st.just({"type": "object"})}), max_size=2),
    "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
                             st.fixed_dictionaries({"type": st.just("tool"), "name": st.sampled_from(["f", "h"])})),
    "thinking": st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": st.integers(-1, 100)}),
    "unknown_field": _junk,
}
_WIDE_MESSAGES = {"max_tokens": _WIDE_COMMON["max_tokens"], "temperature": st.floats(-1, 3),
                  "stop_sequences": st.lists(st.text(max_size=4), max_size=20)}


def test_fuzz_messages(http):
    """Anthropic's /v1/messages (its body translated into a chat request): no body gets a 5xx,
    and errors keep Anthropic's shape."""
    seen: list[int] = []

    @_FUZZ
    @given(_bodies(_VALID_MESSAGES, _WIDE_MESSAGES, ("model", "messages", "max_tokens")))
    def run(body: dict) -> None:
        r = http.post("/v1/messages", content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (body, r.status_code, r.text)
        seen.append(r.status_code)
        if r.status_code != 200:
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
        elif body.get("stream") is True:
            assert "event: error" not in r.text, (body, r.text)

    run()
    _report("/v1/messages", seen)


# The document's promises, checked on every response: no 5xx; each status, content type, header and
# body as documented; a request without the key refused (the document declares bearer auth).
_CONFORMANCE = [
    not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_headers_conformance,
    openapi_checks.response_schema_conformance,
    openapi_checks.ignored_auth,
    openapi_checks.negative_data_rejection,
]


def test_fuzz_every_route_from_the_openapi_document(srv, http):
    """Valid and invalid requests generated from /openapi.json for every route (schemathesis)."""
    api = schemathesis.openapi.from_url(f"{srv.url}/openapi.json", headers=srv.headers)
    cases = st.one_of(api.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      api.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    seen: list[tuple[str, int]] = []

    # No shrinking: a failure is reported as found (schemathesis' message has the request to replay).
    @settings(max_examples=FUZZ_OPENAPI_EXAMPLES, deadline=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case) -> None:
        response = case.call_and_validate(headers=srv.headers, checks=_CONFORMANCE, timeout=60)
        seen.append((case.operation.path, response.status_code))

    run()
    statuses = {code: [c for _, c in seen].count(code) for code in sorted({c for _, c in seen})}
    print(f"\nopenapi fuzz: {len(seen)} cases over {len({p for p, _ in seen})} routes, statuses {statuses}")
    assert len({p for p, _ in seen}) >= 10 and 200 in statuses and 400 in statuses
    _normal_request_works(http)


# ---- (6) the API key on every route ----
def _routes(routes: list) -> list[tuple[str, set[str]]]:
    """(path, methods) of every route, looking inside included routers (however FastAPI wraps them)."""
    out = []
    for r in routes:
        inner = getattr(r, "original_router", None) or getattr(r, "routes", None)
        if hasattr(r, "path"):
            out.append((r.path, set(getattr(r, "methods", None) or {"GET"})))
        elif inner is not None:
            out += _routes(inner.routes if hasattr(inner, "routes") else inner)
    return out


def test_every_route_but_health_needs_the_api_key(srv, tiny_model_dir):
    app = create_app(load_config({"model.path": str(tiny_model_dir), "server.api_key": KEY}))
    routes = [(m, path) for path, methods in _routes(app.routes) for m in sorted(methods)]
    assert len(routes) > 15  # the enumeration found the app's routes, not an empty list
    for method, route in routes:
        if route == "/health":
            continue
        path = re.sub(r"\{[^}]*\}", "x", route)  # a path parameter, if a route ever has one
        r = httpx.request(method, f"{srv.url}{path}", json={})
        assert r.status_code == 401, (method, path, r.status_code, r.text)
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_x_api_key(srv):
    """The key as Anthropic's clients send it (`x-api-key`) or as a bearer token; without it, a 401
    in the API's shape on its routes."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{srv.url}/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
    missing = httpx.post(f"{srv.url}/v1/messages", json=body)
    wrong = httpx.post(f"{srv.url}/v1/messages", json=body, headers={"x-api-key": "nope"})
    openai_shape = httpx.post(f"{srv.url}/v1/chat/completions", json=body)
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error" and missing.json()["type"] == "error"
    assert "x-api-key" in missing.json()["error"]["message"]
    assert openai_shape.status_code == 401 and openai_shape.json()["error"]["code"] == 401  # OpenAI's shape there
    for auth in ({"default_headers": {"x-api-key": KEY}}, {"api_key": KEY}):
        claude = anthropic.Anthropic(base_url=srv.url, max_retries=0, **auth)
        msg = claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert msg.usage.output_tokens >= 1 and msg.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])


# ---- limits ----
def test_body_size_limit(http):
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}
    r = http.post("/v1/completions", json=big)  # Content-Length announces it
    assert r.status_code == 413 and "server.max_body_bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit counts the bytes as they arrive
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"x" * 1024
        yield b'", "max_tokens": 1}'

    r = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    _normal_request_works(http)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ("/v1/completions", {"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ("/v1/completions", {"stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"n": 129}, "n"),
        ("/v1/completions", {"max_tokens": 100_000}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi " * 600}, "prompt"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
        ("/v1/chat/completions", {"max_tokens": "8"}, "max_tokens"),
    ],
)
def test_limits_name_the_field(http, path, extra, param):
    base = {"model": MODEL, "max_tokens": 2}
    base |= {"prompt": "hi"} if "completions" in path and "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    r = http.post(path, json=base | extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sampling_params": {"stop": [f"s{i}" for i in range(17)]}}, "sampling_params.stop"),
        ({"sampling_params": {"logit_bias": {str(i): 1 for i in range(301)}}}, None),
        ({"sampling_params": {"stop_token_ids": [1] * 1025}}, "sampling_params.stop_token_ids"),
        ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"cache_salt": "x" * 300}, "cache_salt"),
    ],
)
def test_native_limits(http, body, param):
    r = http.post("/generate", json={"text": "hi"} | body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


# ---- isolation ----
def test_cache_salt_separates_prefixes(http):
    assert http.post("/flush_cache").status_code == 200
    prompt = list(range(10, 90))

    def cached(salt: str | None) -> int:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}} | ({"cache_salt": salt} if salt else {})
        r = http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == len(prompt) - 1  # the same salt shares its prefix
    assert cached("tenant-b") == 0  # another salt does not
    assert cached(None) == 0  # nor does an unsalted request
    assert cached(None) == len(prompt) - 1

    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "tell me a story " * 5}]}
    usage = [http.post("/v1/chat/completions", json=chat | {"cache_salt": s}).json()["usage"] for s in ("x", "y", "x")]
    hits = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert hits[0] == 0 and hits[1] == 0 and hits[2] == usage[2]["prompt_tokens"] - 1, hits
