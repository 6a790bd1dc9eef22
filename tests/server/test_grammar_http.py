"""Structured output on the native `/generate` route of the real server (tiny Llama, CPU)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

GREEDY = {"temperature": 0}
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


def _events(http: httpx.Client, body: dict) -> list:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize(
    ("params", "param", "reason"),
    [
        ({"regex": "[a-z"}, "sampling_params.regex", "invalid regex"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema", "invalid json_schema"),
        ({"json_schema": '{"type": "objekt"}'}, "sampling_params.json_schema", "objekt"),
        ({"ebnf": 'root ::= "a" missing'}, "sampling_params.ebnf", "missing"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params.ebnf", "at most one"),
        ({"regex": 5}, "sampling_params.regex", "a string"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_constraint_is_400_before_decoding(http, params, param, reason, stream):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}, "stream": stream}
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and reason in err["message"], err
    assert "/project/cpp" not in err["message"]  # the compiler's reason, without its log prefix
    stats = http.get("/get_server_info").json()["stats"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def _matches(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def _validates(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


@pytest.mark.parametrize(
    ("params", "valid"),
    [
        ({"regex": r"(cat|dog)-[0-9]{2,4}", "max_new_tokens": 12}, _matches(r"(cat|dog)-[0-9]{2,4}")),
        ({"json_schema": json.dumps(SCHEMA), "max_new_tokens": 40}, _validates),
        ({"ebnf": 'root ::= "v" [0-9] "." [0-9]', "max_new_tokens": 8}, _matches(r"v[0-9]\.[0-9]")),
    ],
)
def test_constrained_stream_and_non_stream_agree(http, params, valid):
    body = {"text": "Output:", "sampling_params": {**params, **GREEDY}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["meta_info"]["finish_reason"]["type"] == "stop"
    assert valid(whole["text"]), whole["text"]
    chunks = _events(http, body)  # cumulative: each chunk extends the previous one
    assert len(chunks) > 1 and all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:], strict=False))
    assert (chunks[-1]["text"], chunks[-1]["output_ids"]) == (whole["text"], whole["output_ids"])
