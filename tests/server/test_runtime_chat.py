"""`Runtime.chat` with tools and structured output against the server: the demo model behind the
real server, driven by the official `openai` client, is the reference for the same request made
from Python (same greedy text, same parsed tool calls); forced calls validate against their schema
(`jsonschema`); bad inputs are ValueErrors naming the field."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest
from test_openai_tools import ASK, NAMED, SCHEMAS, TOOLS

MAX_TOKENS = 60  # forced calls and the schema finish within it
FREE_MAX_TOKENS = 20  # unconstrained replies run to the limit: a short one compares as well
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CASES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Name three colours."}]},
    "auto": {"messages": ASK, "tools": TOOLS},
    "required": {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    "named": {"messages": ASK, "tools": TOOLS, "tool_choice": NAMED},
    "none": {"messages": ASK, "tools": TOOLS, "tool_choice": "none"},
    "json_object": {"messages": [{"role": "user", "content": "Describe a cat as JSON."}],
                    "response_format": {"type": "json_object"}},
    "json_schema": {"messages": [{"role": "user", "content": "Invent a person."}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
}


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def rt(demo_runtime):
    return demo_runtime


@pytest.mark.parametrize("case", list(CASES))
def test_chat_matches_the_server(rt, client, case):
    request = CASES[case]
    budget = MAX_TOKENS if case in ("required", "named", "json_schema") else FREE_MAX_TOKENS
    server = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=budget, **request
    ).choices[0]
    out = rt.chat(sampling_params={"max_new_tokens": budget, "temperature": 0}, **request)
    server_calls = [(c.function.name, c.function.arguments) for c in server.message.tool_calls or []]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in out.get("tool_calls", [])]
    assert (out["text"] or None, calls) == (server.message.content, server_calls)
    for call in out.get("tool_calls", []):
        assert call["id"].startswith("call_") and call["type"] == "function"
    if case in ("required", "named"):
        assert len(calls) == 1 and (case == "required" or calls[0][0] == "get_weather")
        jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])
    if case == "json_schema":
        jsonschema.validate(json.loads(out["text"]), PERSON)
    if case == "auto":
        assert "<tool_call>" not in out["text"]


def test_async_chat_forced_call(rt):
    chat = rt.async_chat(ASK, {"max_new_tokens": MAX_TOKENS, "temperature": 0}, tools=TOOLS, tool_choice=NAMED)
    out = asyncio.run(chat)
    (call,) = out["tool_calls"]
    assert call["function"]["name"] == "get_weather" and out["text"] == ""
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])


def test_tool_result_in_history_is_rendered(rt):
    first = rt.chat(ASK, {"max_new_tokens": MAX_TOKENS, "temperature": 0}, tools=TOOLS, tool_choice=NAMED)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
               {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "Sunny, 24 degrees."}]
    out = rt.chat(history, {"max_new_tokens": 8, "temperature": 0}, tools=TOOLS)
    assert out["meta_info"]["prompt_tokens"] > first["meta_info"]["prompt_tokens"] and out["text"]


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "sampling_params": {"regex": "a+"}}, "response_format"),
        ({"messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
         "messages[0].content[0]"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(rt, fields, field):
    kwargs = {"messages": ASK, "sampling_params": {"max_new_tokens": 4}} | fields
    with pytest.raises(ValueError, match=re.escape(field)):
        rt.chat(**kwargs)
    assert rt.chat(ASK, {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2  # still serving


def test_reply_reads_calls_as_the_server_does():
    """The reply of a model that wrote Hermes call markup: the server's reader (`reply_message`) is
    the reference for the Python result's text and calls."""
    from rxf.entrypoints.chat.prompt import ChatPrompt
    from rxf.entrypoints.chat.reply import ReplyFormat
    from rxf.entrypoints.chat.tool_parsers.hermes import HermesParser
    from rxf.entrypoints.chat.tools import ToolPlan
    from rxf.entrypoints.openai.tool_calls import reply_message
    from rxf.entrypoints.runtime_chat import ChatCall

    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
    plan = ToolPlan(TOOLS, HermesParser())
    out = ChatCall(ChatPrompt("", None, None), {}, plan, None).reply({"text": text, "meta_info": {}})
    content, calls = reply_message(ReplyFormat(tools=plan).split(text))
    assert out["text"] == content == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out["tool_calls"]] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    single = ChatCall(ChatPrompt("", None, None), {}, ToolPlan(TOOLS, HermesParser(), max_calls=1), None).reply({"text": text})
    assert [c["function"]["name"] for c in single["tool_calls"]] == ["get_weather"]  # parallel_tool_calls off
