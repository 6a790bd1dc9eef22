"""Structured output end to end through the OpenAI API: `response_format` (json_object,
json_schema) on chat, the `regex` / `ebnf` / `json_schema` extension fields on completions, with
the demo model (SmolLM2-135M-Instruct) behind the real server and the official `openai` client.
Outputs are checked with `json` + `jsonschema` and `re.fullmatch`; invalid constraints are 400s
naming the field, streamed or not."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "pet", "scores", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person called Ada as JSON."}]
PHONE = r"\+1-[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


def chat_text(client: OpenAI, stream: bool, **kwargs: Any) -> tuple[str, str]:
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_json_object(client, model):
    kwargs = dict(model=model, messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    text, finish = chat_text(client, False, **kwargs)
    assert finish == "stop" and isinstance(json.loads(text), dict)
    assert chat_text(client, True, **kwargs) == (text, finish)


def test_json_schema_greedy_and_sampled(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kwargs = dict(model=model, messages=ASK, response_format=fmt, max_tokens=150)
    text, finish = chat_text(client, False, temperature=0, **kwargs)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert chat_text(client, True, temperature=0, **kwargs) == (text, finish)
    for seed in range(2):
        text, finish = chat_text(client, seed == 1, temperature=1.0, seed=seed, **kwargs)
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_completion_constraints(client, model):
    def complete(**extra: Any) -> str:
        out = client.completions.create(model=model, prompt="Call me at", max_tokens=40, extra_body=extra, temperature=0)
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].text

    assert re.fullmatch(PHONE, complete(regex=PHONE))
    assert complete(ebnf='root ::= ("yes" | "no") "!"') in ("yes!", "no!")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    jsonschema.validate(json.loads(complete(json_schema=json.dumps(schema))), schema)
    for seed in range(3):
        out = client.completions.create(
            model=model, prompt="Call me at", max_tokens=40, seed=seed, temperature=1.0, extra_body={"regex": PHONE}
        )
        assert re.fullmatch(PHONE, out.choices[0].text)


def test_constrained_and_free_requests_batched_together(client, model):
    free = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    alone = client.completions.create(**free).choices[0].text
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(
            client.completions.create, model=model, prompt="Call me at", max_tokens=40, temperature=0,
            extra_body={"regex": PHONE},
        )
        together = pool.submit(client.completions.create, **free)
        assert re.fullmatch(PHONE, constrained.result().choices[0].text)
        assert together.result().choices[0].text == alone


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"extra_body": {"regex": "(unclosed"}}, "regex", "invalid regex"),
        ({"extra_body": {"ebnf": "root ::= missing_rule"}}, "ebnf", "invalid ebnf"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}},
            "response_format",
            "invalid json_schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "required"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}}, "regex", "at most one"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_constraints(client, model, fields, param, words, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, stream=stream, **fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"], info.value.body


def test_invalid_completion_constraint(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=4, stream=True, extra_body={"json_schema": "{not json"})
    assert info.value.body["param"] == "json_schema" and "invalid json_schema" in info.value.body["message"]


def test_no_grammar_backend_is_a_clear_400(server_factory):
    srv = server_factory({"grammar.backend": "none"})  # the tiny model: only the refusal matters here
    client = OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format" and "grammar.backend" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4, tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
        )
    assert info.value.body["param"] == "tools"
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).usage.completion_tokens == 2
