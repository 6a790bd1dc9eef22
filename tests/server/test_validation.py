"""Issue 16's validation items through HTTP against the demo server (the `openai` client for the
OpenAI routes): every numeric field range-checked and one context rule for max_new_tokens at both
doors; chat inputs that used to pass (an uncompilable tool schema under "auto", no messages, a tool
result without its call id, call arguments that are not JSON, logprob_start_len = -10**6); and
errors that quote the input they refuse only in part. Each is a 400 naming the field, and the
server serves on."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import openai
import pytest

from rxf.core.echo import MAX_ECHO_CHARS

GREEDY = {"temperature": 0, "ignore_eos": True}
BIG = 10**400  # 400 digits: JSON carries it, Python parses it


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def context(http) -> int:
    return http.get("/get_model_info").json()["context_length"]


def assert_400(r: httpx.Response, param: str | None, *words: str) -> str:
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    return error["message"]


def assert_serving(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "still there?", "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text


# ---- item 2: ranges, and the context rule ----
NATIVE_OUT_OF_RANGE = [
    {"max_new_tokens": 2**63},
    {"min_new_tokens": 2**40},
    {"temperature": 1e300},
    {"repetition_penalty": 1e-300},  # 0 in float32: logits / 0 would be inf, a NaN row
    {"top_k": 10**30},
    {"seed": 2**64},
    {"frequency_penalty": 1e9},
    {"logit_bias": {"5": 1e9}},
]


@pytest.mark.parametrize("params", NATIVE_OUT_OF_RANGE, ids=lambda p: next(iter(p)))
def test_native_numbers_out_of_range_are_400(http, params):
    (name,) = params
    r = http.post("/generate", json={"text": "hi", "sampling_params": params}, timeout=15)
    assert_400(r, f"sampling_params.{name}", "must be in")


def test_native_max_new_tokens_must_fit_the_context(http, context):
    prompt_len = len(http.post("/v1/tokenize", json={"prompt": "hi"}).json()["tokens"])
    too_many = {"text": "hi", "sampling_params": {"max_new_tokens": context - prompt_len + 1}}
    assert_400(http.post("/generate", json=too_many, timeout=15), "sampling_params.max_new_tokens",
               f"context length {context}", f"at most {context - prompt_len} new tokens fit")
    assert_serving(http)


def test_logprob_start_len_is_range_checked(http):
    body = {"text": "hi", "return_logprob": True, "logprob_start_len": -(10**6)}
    assert_400(http.post("/generate", json=body), "logprob_start_len", "-1")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"extra_body": {"top_k": 10**30}}, "top_k"),
        ({"extra_body": {"repetition_penalty": 1e-300}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 2**40}}, "min_tokens"),
        ({"presence_penalty": 1e300}, "presence_penalty"),
    ],
)
def test_openai_numbers_out_of_range_are_400(client, model, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi", **{"max_tokens": 2, **fields})
    assert err.value.body["param"] == param, err.value.body


# ---- item 6: chat inputs ----
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _chat_error(client, model: str, **fields: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, **{"messages": CHAT, "max_tokens": 2, **fields})
    return err.value.body


def test_a_tool_schema_that_is_no_json_schema_is_400_under_auto(client, model):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    body = _chat_error(client, model, tools=tools, tool_choice="auto")
    assert body["param"] == "tools[1].function.parameters" and "not a valid JSON schema" in body["message"], body


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([], "messages", "at least 1"),
        ([*CHAT, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}],
         "messages[2].tool_call_id", "tool_call_id"),
        ([*CHAT, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                               "arguments": "{city: Paris"}}]}],
         "messages[1].tool_calls[0].function.arguments", "not JSON"),
        ([*CHAT, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "[1]"}}]}],
         "messages[1].tool_calls[0].function.arguments", "object"),
        ([*CHAT, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_other", "content": "sunny"}],
         "messages", "messages[2].tool_call_id: 'call_other' answers no tool call of an earlier assistant message"),
        ([*CHAT, {"role": "tool", "tool_call_id": CALL["id"], "content": "sunny"}], "messages", "answers no tool call"),
    ],
    ids=["no-messages", "no-tool-call-id", "arguments-not-json", "arguments-not-an-object", "unknown-call-id",
         "result-before-its-call"],
)
def test_bad_conversations_are_400_naming_the_field(client, model, http, messages, param, words):
    body = _chat_error(client, model, messages=messages)
    assert body["param"] == param and words in body["message"], body
    if not messages:  # /v1/tokenize takes the same messages
        assert_400(http.post("/v1/tokenize", json={"messages": []}), "messages", "at least 1")


def test_a_well_formed_tool_conversation_is_accepted(client, model):
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1


# ---- item 8: bounded echoes ----
def _bounded(message: str) -> None:
    assert len(message) < 4 * MAX_ECHO_CHARS + 300 and "...[" in message, message[:600]


def test_a_4000_character_role_is_not_echoed_whole(client, model):
    body = _chat_error(client, model, messages=[{"role": "r" * 4000, "content": "hi"}])
    _bounded(body["message"])
    assert "4000 characters" in body["message"]


def test_400_digit_numbers_are_not_echoed_whole(http, model):
    for path, body in [
        ("/v1/completions", {"model": model, "prompt": "hi", "seed": BIG}),
        ("/v1/completions", {"model": model, "prompt": "hi", "n": BIG}),
        ("/v1/chat/completions", {"model": model, "messages": CHAT, "max_completion_tokens": BIG}),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": BIG}}),
        ("/generate", {"text": "hi", "priority": BIG}),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text[:300])
        _bounded(r.json()["error"]["message"])


def test_a_1mb_rid_is_refused_and_not_echoed(http):
    r = http.post("/generate", json={"text": "hi", "rid": "r" * 1_000_000, "sampling_params": {"max_new_tokens": 1}})
    message = assert_400(r, "rid", "at most 256 characters")
    assert len(r.content) < 1000, message[:300]
    assert_serving(http)


def test_a_batch_past_the_server_capacity_is_refused_before_it_is_tokenized(http, model):
    # Counted first: its first prompt's out-of-vocabulary id would be the error of a batch that was
    # prepared (tokenized, validated) before the count, which 300,000 text prompts made take 11 s.
    scheduler = http.get("/get_server_info").json()["config"]["scheduler"]
    limit = scheduler["max_running_requests"] + scheduler["max_queued_requests"]  # dp 1
    r = http.post("/generate", json={"input_ids": [[10**6]] + [[1, 2]] * limit, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and f"needs {limit + 1} generations" in r.json()["error"]["message"], r.text[:300]
    body = {"model": model, "prompt": [[10**6]] + [[1, 2]] * (limit // 2), "n": 2, "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    want = 2 * (limit // 2 + 1)
    assert r.status_code == 400 and f"needs {want} generations" in r.json()["error"]["message"], r.text[:300]
    assert_serving(http)


def test_an_integer_past_pythons_digit_limit_is_400_saying_so(http):
    digits = sys.get_int_max_str_digits() + 700  # the client's json module cannot write it: sent as text
    body = '{"text": "hi", "sampling_params": {"top_k": ' + "9" * digits + "}}"
    r = http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert f"an integer of over {sys.get_int_max_str_digits()} digits" in r.json()["error"]["message"]
    assert_serving(http)


def test_continuing_a_lone_assistant_message_says_what_is_missing(client, model, http):
    # It said "messages must be a non-empty list of message objects"; a 405 was typed server_error.
    body = _chat_error(client, model, messages=[{"role": "assistant", "content": "Once upon"}],
                       extra_body={"continue_final_message": True})
    assert body["param"] == "messages" and "needs a message before the assistant's final one" in body["message"], body
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text
