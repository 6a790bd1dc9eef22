"""The events of a streamed /v1/responses response, driven by a fake TokenizerManager: calls read from
a reply's markup in pieces, an engine failure midway, an abort on request (the server tests cover
the demo model's streams)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.frontend.tokenizer_manager import EngineDeadError
from rxf.core.ipc.messages import ABORT_REQUESTED, FinishReason
from rxf.entrypoints.chat.reasoning.think import ThinkParser
from rxf.entrypoints.chat.reply import ReplyFormat
from rxf.entrypoints.chat.tool_parsers.hermes import HermesParser
from rxf.entrypoints.chat.tools import ToolPlan
from rxf.entrypoints.openai.responses_output import ResponsePlan, output_items
from rxf.entrypoints.openai.responses_protocol import ResponsesRequest
from rxf.entrypoints.openai.responses_stream import response_events
from rxf.entrypoints.openai.serving_chat import ChatPlan


def out(text: str, finish: FinishReason | None = None) -> GenerateOutput:
    """An output whose tokens are its characters' code points."""
    return GenerateOutput("r", text, [ord(c) for c in text], prompt_tokens=3, completion_tokens=1, cached_tokens=0, finish_reason=finish)


class FakeTokenizerManager:
    def __init__(self, outputs: list[GenerateOutput], then: Exception | None) -> None:
        self.outputs, self.then = outputs, then

    async def generate(self, req: Any):
        for item in self.outputs:
            yield item
        if self.then is not None:
            raise self.then


def response_plan(tools: ToolPlan | None, thinks: bool = False) -> ResponsePlan:
    """A plan whose replies are read with `tools`, and whose prompt opened a <think> block if it `thinks`."""
    reply = ReplyFormat(ThinkParser() if thinks else None, thinks, tools)
    chat = ChatPlan("c", None, [None], False, tools, reply)  # type: ignore[arg-type]
    return ResponsePlan("resp_1", ResponsesRequest(input="hi"), chat, [], "m", lambda ids: "".join(map(chr, ids)))


def events(
    outputs: list[GenerateOutput], then: Exception | None = None, tools: ToolPlan | None = None, thinks: bool = False
) -> tuple[list[dict[str, Any]], list]:
    plan = response_plan(tools, thinks)
    done: list = []

    async def run() -> list[str]:
        return [e async for e in response_events(FakeTokenizerManager(outputs, then), plan, done.append)]  # type: ignore[arg-type]

    sent = asyncio.run(run())
    parsed = []
    for event in sent:
        head, data = event.strip().split("\n")
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {parsed[-1]['type']}"
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    return parsed, done


REPLY = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, len(REPLY)])
def test_calls_stream_as_the_whole_reply_reads(step):
    tools = ToolPlan([], HermesParser())
    chunks = [REPLY[i : i + step] for i in range(0, len(REPLY), step)]
    parsed, done = events([out(c) for c in chunks[:-1]] + [out(chunks[-1], FinishReason("stop"))], tools=tools)
    final = parsed[-1]["response"]
    assert parsed[-1]["type"] == "response.completed"
    summary = [(i["type"], i.get("name"), i.get("arguments"), i.get("content")) for i in final["output"]]
    whole = response_plan(tools)
    expected = [(i.type, getattr(i, "name", None), getattr(i, "arguments", None),
                 [p.model_dump() for p in i.content] if i.type == "message" else None)
                for i in output_items(whole, out(REPLY, FinishReason("stop")), "completed")]
    assert summary == expected and [t for t, *_ in summary] == ["message", "function_call", "function_call"]
    for index, item in enumerate(final["output"][1:], start=1):
        fragments = [e["delta"] for e in parsed if e["type"] == "response.function_call_arguments.delta"
                     and e["output_index"] == index]
        assert "".join(fragments) == item["arguments"] and json.loads(item["arguments"]) is not None
    assert [i.id for i in done] == ["resp_1"]


def test_an_engine_failure_midway_is_a_failed_response():
    parsed, done = events([out("Hel"), out("lo")], EngineDeadError("the scheduler died"))
    kinds = [e["type"] for e in parsed]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.failed"]
    failed = parsed[-1]["response"]
    assert failed["status"] == "failed" and "the scheduler died" in failed["error"]["message"]
    assert failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "Hello" and failed["output"][0]["status"] == "incomplete"
    assert not done  # a failed response is not stored


def test_an_abort_on_request_is_an_incomplete_response():
    parsed, done = events([out("Hi"), out(" there", FinishReason("abort", message=ABORT_REQUESTED))])
    final = parsed[-1]
    assert final["type"] == "response.incomplete" and final["response"]["incomplete_details"] == {"reason": None}
    assert final["response"]["output"][0]["content"][0]["text"] == "Hi there"
    assert [r.id for r in done] == ["resp_1"]


THOUGHT = "Weather first, then time.\n</think>\n\n" + REPLY  # the prompt opened the block


@pytest.mark.parametrize("step", [1, 4, len(THOUGHT)])
def test_reasoning_streams_as_a_reasoning_item_first(step):
    """The reasoning item's events come before the message's; the streamed output is the
    non-streamed one, its usage counting the reasoning's tokens."""
    tools = ToolPlan([], HermesParser())
    chunks = [THOUGHT[i : i + step] for i in range(0, len(THOUGHT), step)]
    parsed, _ = events([out(c) for c in chunks[:-1]] + [out(chunks[-1], FinishReason("stop"))], tools=tools, thinks=True)
    final = parsed[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    reasoning = final["output"][0]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Weather first, then time."}]
    deltas = [e["delta"] for e in parsed if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning["content"][0]["text"]
    kinds = [e["type"] for e in parsed]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    whole = output_items(response_plan(tools, thinks=True), out(THOUGHT, FinishReason("stop")), "completed")
    assert [(i.type, getattr(i, "arguments", None)) for i in whole] == [
        (i["type"], i.get("arguments")) for i in final["output"]]
    assert whole[0].content[0].text == reasoning["content"][0]["text"]
    # The tokens are characters: the reasoning's, not its end marker's or the whitespace after it.
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len("Weather first, then time.")
