"""A Responses request against the chat layer and back, without an engine: a call cut off by the
budget, the chat layer's errors in the Responses API's names, and a stream that fails where no
engine failure is (the events of a working stream are tests/unit/test_responses_stream.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.ipc.messages import FinishReason
from rxf.entrypoints.chat.reasoning.think import ThinkParser
from rxf.entrypoints.chat.reply import ReplyFormat
from rxf.entrypoints.openai.responses_input import input_messages, responses_error
from rxf.entrypoints.openai.responses_output import (
    ResponsePlan,
    call_item,
    output_items,
    response_object,
    stored_conversation,
)
from rxf.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    TextConfig,
    TextFormatJsonSchema,
)
from rxf.entrypoints.openai.responses_stream import response_events
from rxf.entrypoints.openai.serving_chat import ChatPlan
from rxf.entrypoints.server_state import APIError


def plan_of(req: ResponsesRequest) -> ResponsePlan:
    chat = ChatPlan("c", None, [None], False, None, ReplyFormat())  # type: ignore[arg-type]
    return ResponsePlan("resp_1", req, chat, [{"role": "user", "content": "call get"}], "m", lambda ids: "")


CUT_OFF = {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": '{"q', "status": "incomplete"}


def test_a_cut_off_call_is_dropped_from_the_conversation():
    """`max_output_tokens` cut the call: its arguments are unfinished JSON. Neither the stored
    conversation nor the response's output sent back as input may carry it (no chat template can
    show it, nothing can answer it): either way the conversation goes on without it."""
    plan = plan_of(ResponsesRequest(input="call get"))
    done = call_item("call_0", "get", '{"q": "a"}', "completed")
    response = response_object(plan, "incomplete", [done, call_item("call_1", "get", '{"q', "incomplete")])
    (_, turn) = stored_conversation(plan, response)
    assert [call["id"] for call in turn["tool_calls"]] == ["call_0"]
    sent_back = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "call get"}, *[item.model_dump() for item in response.output],
        {"role": "user", "content": "go on"}]})
    messages, sources = input_messages(sent_back)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"] and sources == [0, 1, 3]
    assert [call["id"] for call in messages[1]["tool_calls"]] == ["call_0"]
    messages, _ = input_messages(ResponsesRequest.model_validate({"input": [CUT_OFF]}))
    assert messages == []


def test_only_the_last_output_item_is_cut_off():
    """As the stream closes them: an item the model wrote the next one after ended."""
    plan = plan_of(ResponsesRequest(input="x"))
    plan.chat.reply = ReplyFormat(ThinkParser(), True, None)
    out = GenerateOutput("r", "Hmm.</think>Sure, the", [1], prompt_tokens=3, completion_tokens=1, cached_tokens=0,
                         finish_reason=FinishReason("length"))
    reasoning, message = output_items(plan, out, "incomplete")
    assert (reasoning.status, message.status) == ("completed", "incomplete")


def test_a_tool_message_error_names_the_call_id():
    error = APIError(400, "messages[2].tool_call_id: 'nope' answers no tool call of an earlier assistant message",
                     param="messages")
    named = responses_error(error, ["instructions", "input[0]", "input[1]"])
    assert named.param == "input[1].call_id" and named.message.startswith("input[1].call_id: 'nope' answers")


def test_a_stream_that_cannot_write_its_response_ends_with_an_error_event():
    """A response object pydantic cannot write (here a schema nested past its limit, which the
    request model refuses: built around it) ends the stream with the Responses API's `error` event,
    not chat's `{"error": ...}` data."""
    req = ResponsesRequest(input="hi")
    deep: Any = 1
    for _ in range(300):
        deep = [deep]
    fmt = TextFormatJsonSchema.model_construct(type="json_schema", name="x", description=None, strict=None,
                                               schema_={"x": deep})
    req.text = TextConfig.model_construct(format=fmt, verbosity=None)

    async def run() -> list[str]:
        return [e async for e in response_events(None, plan_of(req), lambda response: None)]  # type: ignore[arg-type]

    (event,) = asyncio.run(run())
    head, data = event.strip().split("\n")
    body = json.loads(data.removeprefix("data: "))
    assert head == "event: error" and body["type"] == "error" and body["sequence_number"] == 0
    assert body["code"] == "server_error" and body["message"].startswith("internal error:")
