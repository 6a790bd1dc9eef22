"""The Responses API (/v1/responses) end to end: the demo model (SmolLM2-135M-Instruct) behind the
real server, driven by the official `openai` client's `responses` resource. The reference is the
server's own chat completions route: a response must say, greedily, exactly what the equivalent
chat request says (same prompt, same tokens, same usage), and tool calls and structured output
must validate against their schemas (`jsonschema`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
ASK = "What will the weather be in Paris for the next 3 days?"
GREEDY: dict[str, Any] = {"temperature": 0}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


def chat(client, model: str, messages: list[dict[str, Any]], max_tokens: int, **kwargs: Any):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)


def assert_same_as_chat(response, completion) -> None:
    choice = completion.choices[0]
    assert response.output_text == choice.message.content
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens
    assert response.usage.total_tokens == completion.usage.total_tokens
    if choice.finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_text_input_with_instructions(client, model):
    response = client.responses.create(model=model, input="Name a colour.", instructions="Answer in one word.",
                                       max_output_tokens=12, **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert response.instructions == "Answer in one word." and response.max_output_tokens == 12
    expected = chat(client, model, [{"role": "system", "content": "Answer in one word."},
                                    {"role": "user", "content": "Name a colour."}], 12)
    assert_same_as_chat(response, expected)


def test_message_items(client, model):
    items = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ada."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]},
        {"role": "user", "content": "What is my name?"},
    ]
    response = client.responses.create(model=model, input=items, max_output_tokens=10, **GREEDY)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi, I am Ada."},
                {"role": "assistant", "content": "Hello Ada."}, {"role": "user", "content": "What is my name?"}]
    assert_same_as_chat(response, chat(client, model, messages, 10))


def test_stream_events(client, model):
    kwargs = dict(model=model, input="Tell me about cats.", max_output_tokens=16, **GREEDY)
    expected = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete" if expected.status == "incomplete" else "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == expected.output_text == final.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (expected.usage.input_tokens, expected.usage.output_tokens)
    assert events[2].item.id == final.output[0].id == events[-2].item.id
    # The SDK's helper accumulates the same events into the same response.
    with client.responses.stream(model=model, input="Tell me about cats.", max_output_tokens=16, **GREEDY) as stream:
        helper_text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert helper_text == text
    with pytest.raises(RuntimeError, match="response.completed"):  # it stopped at max_output_tokens
        stream.get_final_response()


def test_logprobs(client, model):
    kwargs = dict(model=model, input="Name a colour.", max_output_tokens=6, top_logprobs=2,
                  include=["message.output_text.logprobs"], **GREEDY)
    logprobs = client.responses.create(**kwargs).output[0].content[0].logprobs
    expected = chat(client, model, [{"role": "user", "content": "Name a colour."}], 6, logprobs=True,
                    top_logprobs=2).choices[0].logprobs.content
    assert [(lp.token, len(lp.top_logprobs)) for lp in logprobs] == [(lp.token, 2) for lp in expected]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.token for lp in logprobs] == [lp.token for lp in events[-1].response.output[0].content[0].logprobs]


def test_function_call_round_trip(client, model):
    first = client.responses.create(model=model, input=ASK, tools=TOOLS, max_output_tokens=48,
                                    tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees."}
    # The agent's turn: the result answers the stored call...
    second = client.responses.create(model=model, previous_response_id=first.id, input=[result], tools=TOOLS,
                                     tool_choice="none", max_output_tokens=16, **GREEDY)
    assert second.output[0].type == "message" and second.previous_response_id == first.id
    # ...as it does when the whole conversation is sent back as items, and as in chat.
    resent = client.responses.create(model=model, input=[{"role": "user", "content": ASK}, call.model_dump(), result],
                                     tools=TOOLS, tool_choice="none", max_output_tokens=16, store=False, **GREEDY)
    assert resent.output_text == second.output_text
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 degrees."}]
    assert_same_as_chat(second, chat(client, model, messages, 16, tools=CHAT_TOOLS, tool_choice="none"))


def test_streamed_function_call(client, model):
    kwargs = dict(model=model, input=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_output_tokens=60, **GREEDY)
    expected = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"] * len(added) and added
    final = events[-1].response
    assert events[-1].type == "response.completed"
    for index, item in enumerate(final.output):
        fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == index]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index]
        assert "".join(fragments) == done.arguments == item.arguments
        jsonschema.validate(json.loads(item.arguments), WEATHER)
    assert [(i.name, i.arguments) for i in final.output] == [(i.name, i.arguments) for i in expected.output]


def summary(output) -> list[tuple[str, str]]:
    return [(i.type, i.content[0].text if i.type == "message" else i.name + i.arguments) for i in output]


def test_auto_tools_stream_matches_create(client, model):
    # (The demo model answers in text here; tests/unit/test_responses_stream.py streams calls read
    # from markup.)
    kwargs = dict(model=model, input=ASK, tools=TOOLS, max_output_tokens=30, **GREEDY)
    expected = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    final = events[-1].response
    assert summary(final.output) == summary(expected.output) and final.status == expected.status
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == [i.type for i in final.output]
    assert "<tool_call>" not in final.output_text


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True},
    {"type": "json_object"},
])
def test_structured_output(client, model, fmt):
    response = client.responses.create(model=model, input="Describe a person called Ada as JSON.",
                                       text={"format": fmt}, max_output_tokens=60, **GREEDY)
    assert response.status == "completed" and response.text.format.type == fmt["type"]
    value = json.loads(response.output_text)
    jsonschema.validate(value, PERSON if fmt["type"] == "json_schema" else {"type": "object"})


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


def test_parse_with_a_pydantic_model(client, model):
    parsed = client.responses.parse(model=model, input="Describe a person called Ada as JSON.", text_format=Person,
                                    max_output_tokens=60, **GREEDY)
    assert isinstance(parsed.output_parsed, Person) and parsed.status == "completed"


def test_previous_response_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=10, **GREEDY)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=10, **GREEDY)
    # The earlier turn's instructions are not carried over; its input and output are.
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    assert_same_as_chat(second, chat(client, model, messages, 10))


def test_a_call_cut_off_by_the_budget_can_be_continued(client, model):
    """The cut-off call (its arguments unfinished JSON) is left out of the conversation, whether it
    continues from the stored response or from its output sent back."""
    cut = client.responses.create(model=model, input="Call get_weather.", tools=TOOLS, tool_choice="required",
                                  max_output_tokens=14, **GREEDY)
    (call,) = cut.output
    assert cut.status == "incomplete" and call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.arguments)
    for more in ({"previous_response_id": cut.id, "input": "Go on."},
                 {"input": [{"role": "user", "content": "Call get_weather."}, call.model_dump(exclude_none=True),
                            {"role": "user", "content": "Go on."}]}):
        assert client.responses.create(model=model, max_output_tokens=2, **more).output_text is not None


def test_cache_salt_and_priority_are_honoured(client, model):
    """vLLM's extensions reach the engine, as on the chat route (they were accepted and ignored: a
    salted request read another tenant's cached prefix)."""
    ask = {"model": model, "input": "A prompt only one tenant has sent before.", "max_output_tokens": 2, **GREEDY}
    salt_a, salt_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"  # no other test of the shared server's
    first = client.responses.create(**ask, extra_body={"cache_salt": salt_a})
    again = client.responses.create(**ask, extra_body={"cache_salt": salt_a})
    other = client.responses.create(**ask, extra_body={"cache_salt": salt_b})
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert other.usage.input_tokens_details.cached_tokens == 0
    assert first.output_text == other.output_text
    with pytest.raises(openai.BadRequestError) as caught:  # priority scheduling is off on this server
        client.responses.create(**ask, extra_body={"priority": 1})
    assert caught.value.body["param"] == "priority"


def test_retrieve_and_delete(client, model):
    created = client.responses.create(model=model, input="Hi", max_output_tokens=4, metadata={"k": "v"}, **GREEDY)
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(created.id)
    for call in (lambda: client.responses.retrieve(created.id), lambda: client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "response_not_found"
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"


DEEP: Any = 1
for _ in range(300):
    DEEP = [DEEP]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": 5}}}},
         "text.format"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"instructions": "Be brief.", "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "x"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[2].content[0]"),
        ({"input": None}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
        # Refused before any work: the response object echoes them (a schema past pydantic's depth
        # limit was a 500 once the reply was written, a long id a flood of the response store).
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "x": DEEP}}}},
         "text.format.schema"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "x": DEEP}}]},
         "tools[0].parameters"),
        ({"user": "u" * 257}, "user"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_requests(client, model, fields, param, stream):
    body = {"model": model, "input": "Hi", "max_output_tokens": 4, "stream": stream} | fields
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=object)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"].startswith(param), error
    assert error["message"].startswith(error["param"]) or param in ("background", "truncation", "input"), error


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="nope", input="Hi", max_output_tokens=2)
    assert info.value.body["code"] == "model_not_found"
