"""What the Responses, Messages (and chat) request models refuse, and how a refusal names the field: the
models behind the server's own error handlers, in a bare FastAPI app (no engine). The whole
server is tests/server/test_openai_responses.py and tests/server/test_anthropic_api.py."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rxf.entrypoints.anthropic.protocol import MessagesRequest
from rxf.entrypoints.chat.tools import MAX_SCHEMA_DEPTH, check_schema_depth
from rxf.entrypoints.http_errors import install_error_handlers
from rxf.entrypoints.openai.protocol import ChatCompletionRequest
from rxf.entrypoints.openai.responses_protocol import ResponsesRequest


def nested(depth: int) -> Any:
    """A JSON value of `depth` nested arrays."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture(scope="module")
def http() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/responses")
    def responses(body: ResponsesRequest) -> dict[str, str]:
        return {}

    @app.post("/v1/messages")
    def messages(body: MessagesRequest) -> dict[str, str]:
        return {}

    @app.post("/v1/chat/completions")
    def chat(body: ChatCompletionRequest) -> dict[str, str]:
        return {}

    return TestClient(app)


def refusal(http: TestClient, path: str, body: dict[str, Any]) -> str:
    """The message of the 400 for `body`, which starts with the field's name (and is the `param`
    of an OpenAI error)."""
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if "param" in error:
        assert error["message"].startswith(f"{error['param']}: "), error
    return error["message"]


def test_a_schema_depth_counts_every_value():
    check_schema_depth({"type": "string", "x": nested(MAX_SCHEMA_DEPTH - 2)})  # the object, the array, ...
    for schema in ({"type": "string", "x": nested(MAX_SCHEMA_DEPTH)},  # an unknown keyword's value
                   {"type": "string", "enum": [nested(MAX_SCHEMA_DEPTH)]},
                   {"not": nested(MAX_SCHEMA_DEPTH)}):
        with pytest.raises(ValueError, match=f"nests deeper than {MAX_SCHEMA_DEPTH}"):
            check_schema_depth(schema)


DEEP = {"type": "object", "x": nested(300)}  # deeper than the response object's serializer writes


@pytest.mark.parametrize(
    ("path", "fields", "field"),
    [
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}},
         "text.format.schema"),
        ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": DEEP}]}, "tools[0].parameters"),
        ("/v1/messages", {"tools": [{"name": "f", "input_schema": DEEP}]}, "tools[0].input_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
         "response_format.json_schema.schema"),
    ],
)
def test_a_deep_schema_is_refused_naming_its_field(http, path, fields, field):
    body = {"model": "m", "max_tokens": 1, "input": "hi", "messages": [{"role": "user", "content": "hi"}]} | fields
    assert refusal(http, path, body).startswith(f"{field}: Value error, the JSON schema nests deeper than")


LONG, LOOSE = "x" * 65, "x" * 257  # past OpenAI's 64 for ids it bounds, past 256 for those it does not


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"user": LOOSE}, "user"),
        ({"prompt_cache_key": LOOSE}, "prompt_cache_key"),
        ({"safety_identifier": LONG}, "safety_identifier"),
        ({"text": {"format": {"type": "json_schema", "name": LONG, "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "description": "d" * 1025, "schema": {}}}},
         "text.format.description"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_a_stored_response_echoes_is_bounded(http, fields, field):
    assert refusal(http, "/v1/responses", {"input": "hi"} | fields).startswith(f"{field}: ")


def test_ids_of_the_bound_are_accepted():
    ResponsesRequest.model_validate({"input": "hi", "user": "u" * 256, "prompt_cache_key": "k" * 256,
                                     "safety_identifier": "s" * 64, "max_output_tokens": 1})


@pytest.mark.parametrize(
    ("path", "fields", "field"),
    [
        ("/v1/responses", {"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input[0].arguments"),
        ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]},
         "input[0].name"),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]},
         "input[0].call_id"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
         "input[0].content[0].text"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema"),
        ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
        ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": 5}]}]},
         "messages[0].content[1].text"),
        ("/v1/messages", {"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "", "input": {}}]}]}, "messages[0].content[0].name"),
        ("/v1/messages", {"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "", "name": "f", "input": {}}]}]}, "messages[0].content[0].id"),
        ("/v1/messages", {"system": [{"type": "text"}]}, "system[0].text"),
    ],
)
def test_an_error_names_the_field_as_the_client_wrote_it(http, path, fields, field):
    """Without the names of union members that pydantic puts in a location (`input[0].message.role`,
    `text.format.json_schema.schema`, `thinking.enabled.budget_tokens`, `content.list[...]`), and at
    the member the value was meant for (a list of blocks, not the string it might have been)."""
    body = {"model": "m", "max_tokens": 1, "input": "hi", "messages": [{"role": "user", "content": "hi"}]} | fields
    assert refusal(http, path, body).startswith(f"{field}: ")
