"""Anthropic's Messages API end to end with the official `anthropic` SDK, against the demo model
(SmolLM2-135M-Instruct) behind the real server. The reference is the server's OpenAI chat route
driven by the `openai` client: the same conversation must give the same greedy reply and token
counts, so the translation loses nothing. (The SDK no longer takes temperature as an argument:
it goes in `extra_body`, as the API still reads it.)"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                                  "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def openai_reply(client, model: str, messages: list[dict[str, Any]], **kwargs: Any):
    out = client.chat.completions.create(model=model, messages=messages, temperature=0, **kwargs)
    return out.choices[0], out.usage


def test_create_matches_the_chat_route(claude, client, model):
    """System (a string, or text blocks), a multi-turn conversation, stop reasons and usage."""
    turns = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]}]
    openai_turns = [{"role": "system", "content": "Answer briefly."}, *turns[:2],
                    {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]}]
    choice, usage = openai_reply(client, model, openai_turns, max_tokens=24)
    for system in ("Answer briefly.", [{"type": "text", "text": "Answer briefly."}]):
        msg = claude.messages.create(model=model, max_tokens=24, system=system, messages=turns, **GREEDY)
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == model
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == choice.message.content
        assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice.finish_reason]
        assert msg.stop_sequence is None
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == usage.prompt_tokens
        assert msg.usage.output_tokens == usage.completion_tokens and msg.usage.cache_creation_input_tokens == 0
    # The second time, the prompt was in the prefix cache: Anthropic counts it as cache reads.
    assert msg.usage.cache_read_input_tokens == usage.prompt_tokens - 1
    short = claude.messages.create(model=model, max_tokens=2, messages=turns, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_cache_salt_and_priority_are_honoured(claude, model):
    """vLLM's extensions reach the engine, as on the chat route (they were accepted and ignored)."""
    ask = [{"role": "user", "content": "A question no other tenant has asked before."}]

    def cached(salt: str) -> int:
        msg = claude.messages.create(model=model, max_tokens=2, messages=ask, extra_body={"temperature": 0, "cache_salt": salt})
        return msg.usage.cache_read_input_tokens

    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"  # salts no other test of the shared server used
    assert cached(a) == 0 and cached(a) > 0 and cached(b) == 0
    with pytest.raises(anthropic.BadRequestError, match="priority"):  # priority scheduling is off here
        claude.messages.create(model=model, max_tokens=2, messages=ask, extra_body={"priority": 1})


def test_stop_sequences(claude, model):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    whole = claude.messages.create(model=model, max_tokens=24, messages=ask, **GREEDY).content[0].text
    assert "Paris" in whole
    msg = claude.messages.create(model=model, max_tokens=24, messages=ask, stop_sequences=["Paris", "zzz"], **GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert msg.content[0].text == whole[: whole.index("Paris")]


def test_top_k_and_top_p_reach_the_sampler(claude, model):
    """At temperature 1, top_k 1 or a tiny top_p leaves only the likeliest token: the greedy reply."""
    ask = [{"role": "user", "content": "Name a color."}]
    greedy = claude.messages.create(model=model, max_tokens=12, messages=ask, **GREEDY).content[0].text
    for narrow in ({"top_k": 1}, {"top_p": 1e-9}):
        msg = claude.messages.create(model=model, max_tokens=12, messages=ask, extra_body={"temperature": 1.0} | narrow)
        assert msg.content[0].text == greedy, narrow


def test_a_final_assistant_message_is_continued(claude, client, model):
    """A prefill: the reply continues the final assistant message (the OpenAI route's
    `continue_final_message` too), as the whole greedy reply would have gone on."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    whole, _ = openai_reply(client, model, ask, max_tokens=24)
    text = whole.message.content
    start = text[: text.index(" Paris")]
    prefilled = [*ask, {"role": "assistant", "content": start}]
    msg = claude.messages.create(model=model, max_tokens=24, messages=prefilled, **GREEDY)
    assert msg.content[0].text == text[len(start):] and msg.stop_reason == "end_turn"
    chat, _ = openai_reply(client, model, prefilled, max_tokens=24, extra_body={"continue_final_message": True})
    assert chat.message.content == text[len(start):]


def test_stream_events_and_the_sdk_helper(claude, server, model):
    ask = [{"role": "user", "content": "Tell me about Paris."}]
    whole = claude.messages.create(model=model, max_tokens=16, messages=ask, **GREEDY)
    with claude.messages.stream(model=model, max_tokens=16, messages=ask, **GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    # The raw events, in Anthropic's order: each has its `event:` line (the SDK skips events without one).
    body = {"model": model, "max_tokens": 3, "stream": True, "temperature": 0, "messages": ask}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        text = http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}).text
    events = [(line.removeprefix("event: "), json.loads(data.removeprefix("data: ")))
              for line, data in (chunk.split("\n") for chunk in text.strip().split("\n\n"))]
    assert all(kind == payload["type"] for kind, payload in events)
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["usage"]["input_tokens"] >= 1 and events[-2][1]["usage"]["output_tokens"] == 3


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_forced_tool_use_streamed_and_not(claude, model, choice):
    kwargs = dict(model=model, max_tokens=60, tools=TOOLS, tool_choice=choice, messages=ASK, **GREEDY)
    msg = claude.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    (call,) = msg.content
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the arguments arrived as input_json_delta fragments
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content] == [(call.name, call.input)]


def test_tool_result_round_trip_matches_the_chat_route(claude, client, model):
    first = claude.messages.create(model=model, max_tokens=60, tools=TOOLS, tool_choice={"type": "any"}, messages=ASK, **GREEDY)
    (call,) = first.content
    result = "Sunny, 24 degrees, light wind."
    history = [*ASK, {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]
    msg = claude.messages.create(model=model, max_tokens=24, tools=TOOLS, messages=history, **GREEDY)
    openai_history = [*ASK, {"role": "assistant", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    choice, usage = openai_reply(client, model, openai_history, max_tokens=24, tools=OPENAI_TOOLS)
    assert msg.content and msg.content[0].text == choice.message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == usage.prompt_tokens
    count = claude.messages.count_tokens(model=model, tools=TOOLS, messages=history)
    assert count.input_tokens == usage.prompt_tokens


def test_count_tokens(claude, client, model):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = client.post("/tokenize", body={"model": model, "messages": ask}, cast_to=object)
    assert claude.messages.count_tokens(model=model, messages=ask).input_tokens == rendered["count"]
    with_tools = claude.messages.count_tokens(model=model, messages=ask, tools=TOOLS).input_tokens
    assert with_tools > rendered["count"] + 20  # the tool's description is in the prompt
    hidden = claude.messages.count_tokens(model=model, messages=ask, tools=TOOLS, tool_choice={"type": "none"})
    assert hidden.input_tokens == rendered["count"]


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"max_tokens": None}, 400, "max_tokens: Field required"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": "claude-sonnet-4-5"}, 404, "does not exist"),
        ({"temperature": 101}, 400, "temperature"),
        ({"stop_sequences": [f"s{i}" for i in range(17)]}, 400, "stop_sequences: at most 16"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400, "messages[0].content[0]: images are not supported"),
        ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         400, "messages[1].content[0]: the final assistant message is the start of the reply"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}]},
         400, "messages[0].content[1].text: Input should be a valid string"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, 400, "thinking.budget_tokens: "),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
         "content[0]: 'document' blocks are not supported"),
        ({"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "server tools"),
        ({"tools": [{"name": "t", "input_schema": {"type": "string"}}]}, 400, "input_schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope'"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
         400, "'toolu_x' answers no tool_use block"),
        ({"tool_choice": {"type": "any"}}, 400, "tool_choice: 'any' asks for a tool call, but the request has no tools"),
        ({"tool_choice": {"type": "tool", "name": "f"}}, 400, "tool_choice: 'tool' asks for a tool call"),
    ],
)
def test_errors_in_anthropic_shape(server, model, change, status, says):
    body = {"model": model, "max_tokens": 4, "messages": ASK} | change
    body = {key: value for key, value in body.items() if value is not None}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert says in error["error"]["message"], error


def test_count_tokens_refuses_what_messages_refuses(server, model):
    body = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        answers = [http.post(path, json=body | extra) for path, extra in
                   (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {}))]
    assert [r.status_code for r in answers] == [400, 400]
    assert answers[0].json() == answers[1].json() and "'nope'" in answers[0].json()["error"]["message"]


def test_sdk_raises_the_errors(claude, model):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"), claude.messages.stream(
        model=model, max_tokens=4, messages=ASK, stop_sequences=["x"] * 17
    ) as stream:
        list(stream)
