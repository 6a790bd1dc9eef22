"""Structured output and tool calling in the OpenAI layer, without a server: request -> native
parameters, tools and tool messages through chat templates (checked against transformers'
rendering), and tool calls in responses and stream events (from a scripted engine)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.ipc.messages import FinishReason
from rxf.entrypoints.chat.tool_parsers import parser_class
from rxf.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from rxf.entrypoints.openai.serving_chat import chat_events, chat_response, plan_chat
from rxf.entrypoints.openai.serving_completions import plan_completion
from rxf.entrypoints.server_state import APIError
from rxf.plugins.chat_templates.base import HFChatTemplate, JinjaChatTemplate
from rxf.plugins.chat_templates.builtin import BUILTIN_TEMPLATES
from rxf.testing.checkpoints import make_tiny_tokenizer

CTX, VOCAB = 2048, 512
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "ping"}},
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
]
# A tool-aware template in the Hugging Face style (arguments are read as objects).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>\n"
    '{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}\n</tool_call>\n'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def tool_tok():
    tokenizer = make_tiny_tokenizer(VOCAB)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def plan(tok, **fields: Any):
    return plan_chat(chat(**fields), RequestPreparer(tok, CTX, VOCAB), HFChatTemplate(tok))


def api_error(fn, *args: Any, **kwargs: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# ---- response_format and the constraint fields ----
def test_response_format_and_constraints_become_native_fields(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert plan(tok, response_format={"type": "text"}).prompt.sampling_params.json_schema is None
    assert json.loads(plan(tok, response_format={"type": "json_object"}).prompt.sampling_params.json_schema) == {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert json.loads(plan(tok, response_format=fmt).prompt.sampling_params.json_schema) == schema
    assert plan(tok, regex="[ab]+").prompt.sampling_params.regex == "[ab]+"
    assert plan(tok, ebnf='root ::= "x"').prompt.sampling_params.ebnf == 'root ::= "x"'
    assert json.loads(plan(tok, guided_json=schema).prompt.sampling_params.json_schema) == schema
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "json_schema": json.dumps(schema)})
    assert json.loads(plan_completion(completion, RequestPreparer(tok, CTX, VOCAB)).prompts[0].sampling_params.json_schema) == schema
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "regex": "a|b"})
    assert plan_completion(completion, RequestPreparer(tok, CTX, VOCAB)).prompts[0].sampling_params.regex == "a|b"


@pytest.mark.parametrize(
    "response_format, loc",
    [
        ({"type": "json_schema"}, ("response_format",)),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, ("response_format", "json_schema", "schema")),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, ("response_format", "json_schema", "schema")),
        ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, ("response_format",)),
        ({"type": "xml"}, ("response_format", "type")),
    ],
)
def test_bad_response_format_is_named(response_format, loc):
    with pytest.raises(ValidationError) as info:
        chat(response_format=response_format)
    assert tuple(info.value.errors()[0]["loc"][: len(loc)]) == loc


def test_two_constraints_are_refused(tok):
    error = api_error(plan, tok, **{"response_format": {"type": "json_object"}, "ebnf": "root ::= x"})
    assert error.param == "ebnf" and "response_format and ebnf" in error.message


# ---- tools and tool_choice ----
def test_auto_shows_tools_and_parses_with_the_model_format(tok):
    p = plan(tok, tools=TOOLS)
    prompt = tok.decode(p.prompt.input_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt and "<tool_call>" in prompt
    assert p.prompt.sampling_params.json_schema is None and p.tools.parser.name == "hermes"
    assert "<tools>" not in tok.decode(plan(tok, tools=TOOLS, tool_choice="none").prompt.input_ids)
    assert plan(tok, tools=TOOLS, tool_choice="none").tools is None


def test_required_forces_a_list_of_valid_calls(tok):
    schema = json.loads(plan(tok, tools=TOOLS, tool_choice="required").prompt.sampling_params.json_schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "c"}}],  # misses a required argument
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "k"}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "ping"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(plan(tok, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).prompt.sampling_params.json_schema)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_named_function_forces_its_arguments(tok):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    p = plan(tok, tools=TOOLS, tool_choice=choice)
    assert json.loads(p.prompt.sampling_params.json_schema) == WEATHER_PARAMS and p.tools.parser.function == "get_weather"
    choice = {"type": "function", "function": {"name": "ping"}}
    assert json.loads(plan(tok, tools=TOOLS, tool_choice=choice).prompt.sampling_params.json_schema)["type"] == "object"


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice", "requires tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "get_weather"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "x"}, "tool_choice", "regex"),
    ],
)
def test_tool_errors(tok, fields, param, words):
    error = api_error(plan, tok, **fields)
    assert (error.status, error.param) == (400, param) and words in error.message


@pytest.mark.parametrize(
    "fields, loc",
    [
        ({"tools": [{"type": "retrieval"}]}, ("tools", 0, "type")),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, ("tools", 0, "function", "name")),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, ("tools", 0, "function")),
        ({"tool_choice": "sometimes"}, ("tool_choice",)),
        ({"tool_choice": {"type": "function"}}, ("tool_choice",)),
    ],
)
def test_malformed_tools_are_named(fields, loc):
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    assert tuple(info.value.errors()[0]["loc"][: len(loc)]) == loc


def test_special_token_formats_keep_special_tokens(tok):
    p = plan_chat(chat(tools=TOOLS), RequestPreparer(tok, CTX, VOCAB), HFChatTemplate(tok), tool_parser=parser_class("mistral")())
    assert p.prompt.sampling_params.skip_special_tokens is False
    assert plan(tok, tools=TOOLS).prompt.sampling_params.skip_special_tokens is True


# ---- templates ----
def _hf_reference(tokenizer) -> str:
    """transformers' own rendering, given the arguments as objects (what templates expect)."""
    messages = copy.deepcopy(HISTORY)
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    messages[2]["content"] = ""
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_tool_aware_templates_get_the_structure(tool_tok):
    expected = _hf_reference(tool_tok)
    syntax = parser_class("hermes").syntax
    assert HFChatTemplate(tool_tok).render_with_tools(HISTORY, TOOLS, syntax) == expected
    assert JinjaChatTemplate(TOOL_TEMPLATE).render_with_tools(HISTORY, TOOLS, syntax) == expected
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in expected  # not JSON in a string


def test_templates_without_tools_get_them_as_text(tok):
    syntax = parser_class("hermes").syntax
    prompt = HFChatTemplate(tok).render_with_tools(HISTORY, TOOLS, syntax)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and '"name": "get_weather"' in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>" in prompt
    assert "tool_call_id" not in prompt and "None" not in prompt


def test_builtin_templates_render_tools(tok):
    by_name = {t.name: t for t in BUILTIN_TEMPLATES}
    chatml = by_name["chatml"].render_with_tools(HISTORY, TOOLS, parser_class("hermes").syntax)
    assert "<tools>" in chatml and "<tool_response>\n25 C" in chatml and chatml.endswith("<|im_start|>assistant\n")
    llama3 = by_name["llama-3"].render_with_tools(HISTORY, TOOLS, parser_class("llama3_json").syntax)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather"' in llama3
    assert llama3.count("<|start_header_id|>ipython<|end_header_id|>\n\n") == 2
    for name in ("llama-2", "vicuna"):  # strict alternation: the two results make one user turn
        prompt = by_name[name].render_with_tools(HISTORY + [{"role": "assistant", "content": "Both mild."}], TOOLS,
                                                 parser_class("hermes").syntax)
        assert "21 C" in prompt and "25 C" in prompt and "Both mild." in prompt


def test_history_with_tool_calls_renders_without_tools(tok):
    p = plan_chat(chat(messages=HISTORY), RequestPreparer(tok, CTX, VOCAB), HFChatTemplate(tok))
    prompt = tok.decode(p.prompt.input_ids)
    assert "<tool_call>" in prompt and "<tool_response>" in prompt and "<tools>" not in prompt


# ---- responses and streams ----
def _out(text: str, done: int, finish: FinishReason | None = None) -> GenerateOutput:
    return GenerateOutput("r", text, [1], 5, done, 0, finish)


class ScriptedTM:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    async def generate(self, req):
        for k, piece in enumerate(self.pieces):
            finish = FinishReason("stop") if k == len(self.pieces) - 1 else None
            yield _out(piece, k + 1, finish)
            await asyncio.sleep(0)


async def _events(agen) -> list[dict[str, Any]]:
    out = []
    async with contextlib.aclosing(agen) as events:
        async for item in events:
            out.append(json.loads(item[len("data: ") :]))
    return out


REPLY = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_stream_of_tool_calls(tok):
    p = plan(tok, tools=TOOLS, stream=True)
    pieces = [REPLY[i : i + 3] for i in range(0, len(REPLY), 3)]
    chunks = asyncio.run(_events(chat_events(ScriptedTM(pieces), p, str, "m", include_usage=False)))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather" and all(c["index"] == 0 for c in calls)
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_response_with_tool_calls(tok):
    p = plan(tok, tools=TOOLS)
    result = _out(REPLY, 9, FinishReason("stop"))
    choice = chat_response(p, [result], str, "m").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    plain = chat_response(p, [replace(result, text="No call.")], str, "m").choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == "No call." and plain.message.tool_calls is None
    body = chat_response(p, [replace(result, text="No call.")], str, "m").model_dump()
    assert "tool_calls" not in json.dumps(body)
