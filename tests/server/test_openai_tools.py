"""Tool calling end to end: the demo model (SmolLM2-135M-Instruct, whose template knows no tools,
so they are shown in the Hermes format) behind the real server, driven by the official `openai`
client. Forced tool choices must give calls whose arguments validate against the tool's schema
(`jsonschema`), streamed or not; a tool result sent back gives a normal answer."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 80}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


def assert_valid_calls(calls: list[Any], names: Any) -> None:
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(client: OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, calls (accumulated from the deltas as OpenAI clients do) and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice, parallel, names",
    [(NAMED, True, {"get_weather"}), ("required", False, {"get_weather", "get_time"})],
    ids=["named", "required"],
)
def test_forced_tool_calls(client, model, tool_choice, parallel, names):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel, **GREEDY)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    assert_valid_calls(choice.message.tool_calls, names)
    assert len(choice.message.tool_calls) == 1  # one named function; parallel_tool_calls off
    content, calls, finish = streamed_calls(client, **kwargs)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]


def test_required_calls_sampled(client, model):
    """Sampled lists of calls: every finished call is valid (a reply cut by max_tokens may end in
    an unfinished one)."""
    for seed in range(2):
        out = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=120
        )
        choice = out.choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason in ("tool_calls", "length") and calls
        assert_valid_calls(calls if choice.finish_reason == "tool_calls" else calls[:-1] or calls[:0], SCHEMAS.keys())


def test_tool_result_round_trip(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, **GREEDY)
    (call,) = first.choices[0].message.tool_calls
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # content null: tool_calls only
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees, light wind."},
    ]
    rendered = client.post("/tokenize", body={"model": model, "messages": history}, cast_to=object)
    shown = client.post("/detokenize", body={"model": model, "tokens": rendered["tokens"]}, cast_to=object)["prompt"]
    assert f'"name": "{call.function.name}"' in shown and "Sunny, 24 degrees" in shown and "<tool_response>" in shown
    for stream in (False, True):
        kwargs = dict(model=model, messages=history, tools=TOOLS, tool_choice="none", **GREEDY)
        if stream:
            content, calls, finish = streamed_calls(client, **kwargs)
        else:
            out = client.chat.completions.create(**kwargs)
            content, calls, finish = out.choices[0].message.content, out.choices[0].message.tool_calls, out.choices[0].finish_reason
        assert content and not calls and finish in ("stop", "length")


def test_auto_stream_matches_non_stream(client, model):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    content, calls, finish = streamed_calls(client, **kwargs)
    assert content == (message.content or "") and finish == out.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    assert "<tool_call>" not in content


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_tool_requests(client, model, fields, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, stream=stream, max_tokens=4, **fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
