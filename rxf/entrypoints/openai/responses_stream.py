"""A streamed response: the Responses API's server-sent events (`event: <type>` + `data: {json}`,
each with the next `sequence_number`, no `[DONE]`), as the `openai` SDK's `responses.stream`
accumulates them.

    response.created, response.in_progress
    per output item, in order: response.output_item.added, then
      the reasoning:    response.content_part.added, response.reasoning_text.delta ...,
                        response.reasoning_text.done, response.content_part.done
      a message:        response.content_part.added, response.output_text.delta ...,
                        response.output_text.done, response.content_part.done
      a function call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete; response.failed with the error if the engine fails)

Text after a call opens a new message item, so the items are in the order the model wrote them;
the final response's `output` is exactly the items streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.protocol import ChatTokenLogprob
from rxf.entrypoints.openai.responses_input import responses_error
from rxf.entrypoints.openai.responses_output import (
    ResponsePlan,
    call_item,
    final_response,
    finish_status,
    message_item,
    reasoning_item,
    response_object,
    token_logprobs,
)
from rxf.entrypoints.openai.responses_protocol import (
    FunctionCallOut,
    OutputItem,
    OutputMessage,
    ReasoningOut,
    ResponseObject,
)
from rxf.entrypoints.openai.sse import to_api_error
from rxf.entrypoints.sse_lines import data_json

logger = logging.getLogger(__name__)


def _dumped(logprobs: list[ChatTokenLogprob]) -> list[dict[str, Any]]:
    return [lp.model_dump(mode="json") for lp in logprobs]


class _Events:
    """The output items as they stream, and the events that tell them."""

    def __init__(self) -> None:
        self._sequence = itertools.count()
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None  # the item receiving deltas (always the last one)
        self.calls: dict[int, FunctionCallOut] = {}  # ToolCallStream's call index -> its item
        # Logprobs of tokens whose text has not been sent yet (held back near a stop string, or
        # markup): they go with the next text delta.
        self.logprobs: list[ChatTokenLogprob] = []

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(self._sequence), **fields}
        return f"event: {kind}\ndata: {data_json(json.dumps(body, ensure_ascii=False))}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self.event(kind, response=response.model_dump(mode="json"))

    def add(self, item: OutputItem) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=item.model_dump(mode="json")))
        if isinstance(item, OutputMessage | ReasoningOut):
            part = item.content[0].model_dump(mode="json")
            events.append(self.event("response.content_part.added", item_id=item.id, output_index=index,
                                     content_index=0, part=part))
        return events

    def reasoning(self, delta: str) -> list[str]:
        events = [] if isinstance(self.open, ReasoningOut) else self.add(reasoning_item("", "in_progress"))
        item = self.open
        assert isinstance(item, ReasoningOut)
        item.content[0].text += delta
        events.append(self.event("response.reasoning_text.delta", item_id=item.id, output_index=len(self.items) - 1,
                                 content_index=0, delta=delta))
        return events

    def text(self, delta: str) -> list[str]:
        events = [] if isinstance(self.open, OutputMessage) else self.add(message_item("", "in_progress"))
        message = self.open
        assert isinstance(message, OutputMessage)
        part = message.content[0]
        part.text += delta
        part.logprobs += self.logprobs
        events.append(self.event("response.output_text.delta", item_id=message.id, output_index=len(self.items) - 1,
                                 content_index=0, delta=delta, logprobs=_dumped(self.logprobs)))
        self.logprobs = []
        return events

    def call(self, delta: dict[str, Any]) -> list[str]:
        """A `ToolCallStream` call delta: a call's first (id, name, arguments so far) or a fragment."""
        events: list[str] = []
        fragment = delta["function"].get("arguments") or ""
        if "id" in delta:
            item = call_item(delta["id"], delta["function"]["name"], "", "in_progress")
            self.calls[delta["index"]] = item
            events += self.add(item)
        item = self.calls[delta["index"]]
        if fragment:
            item.arguments += fragment
            events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=self.items.index(item), delta=fragment))
        return events

    def close(self, status: str = "completed") -> list[str]:
        """The events ending the open item (none if none is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        index = self.items.index(item)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs += self.logprobs  # tokens whose text never came (a trimmed stop string)
            self.logprobs = []
            events = [
                self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                           text=part.text, logprobs=_dumped(part.logprobs)),
                self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                           part=part.model_dump(mode="json")),
            ]
        elif isinstance(item, ReasoningOut):
            part = item.content[0]
            events = [
                self.event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                           text=part.text),
                self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                           part=part.model_dump(mode="json")),
            ]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                 name=item.name, arguments=item.arguments)]
        return events + [self.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json"))]


async def response_events(
    tm: TokenizerManager, plan: ResponsePlan, on_done: Callable[[ResponseObject], None]
) -> AsyncGenerator[str, None]:
    """The events of `plan`'s response; `on_done` gets the finished response (not a failed one).
    They end with Responses events whatever fails: a failure of the generation with
    response.failed, any other (writing an event, finishing the response) with an `error` event."""
    events = _Events()
    try:
        async with contextlib.aclosing(_stream_events(events, tm, plan, on_done)) as inner:
            async for event in inner:
                yield event
    except Exception as exc:  # after the 200 a failure can only be told in the stream
        logger.exception("response stream failed")
        yield events.event("error", code="server_error", message=f"internal error: {type(exc).__name__}", param=None)


async def _stream_events(
    events: _Events, tm: TokenizerManager, plan: ResponsePlan, on_done: Callable[[ResponseObject], None]
) -> AsyncGenerator[str, None]:
    yield events.lifecycle("response.created", response_object(plan, "in_progress", []))
    yield events.lifecycle("response.in_progress", response_object(plan, "in_progress", []))
    stream = plan.chat.reply.stream()
    final = None
    text, output_ids = "", []  # the reply so far (each output holds what it adds)
    try:
        async with contextlib.aclosing(gen.iterate(tm, plan.chat.reqs, plan.chat.names)) as results:
            async for _, result in results:
                done = result.finish_reason is not None
                text += result.text
                output_ids += result.output_ids
                events.logprobs += token_logprobs(plan, result)
                parts = stream.feed(result.text, final=done)
                for event in events.reasoning(parts.reasoning) if parts.reasoning else []:
                    yield event
                for event in events.text(parts.content) if parts.content else []:
                    yield event
                for call in parts.calls:
                    for event in events.call(call):
                        yield event
                if done:  # the complete final result, as a non-streamed request's
                    final = dataclasses.replace(result, text=text, output_ids=output_ids)
    except Exception as exc:  # after the 200 a failure can only be told in the stream
        error = to_api_error(exc)
        if error is not None:
            error = responses_error(error, [])  # an engine abort names the chat field
        else:
            logger.exception("response stream failed")
        message = error.message if error is not None else f"internal error: {type(exc).__name__}"
        for event in events.close("incomplete"):
            yield event
        yield events.lifecycle("response.failed", response_object(plan, "failed", events.items, error=message))
        return
    assert final is not None
    if all(isinstance(item, ReasoningOut) for item in events.items):  # neither text nor calls: one empty message
        for event in events.add(message_item("", "in_progress")):
            yield event
    status, _ = finish_status(final)
    for event in events.close("incomplete" if status == "incomplete" else "completed"):
        yield event
    # Off the event loop: counting the reasoning's tokens decodes the output a few times.
    response = await asyncio.to_thread(final_response, plan, final, events.items)
    on_done(response)
    yield events.lifecycle("response.completed" if response.status == "completed" else "response.incomplete", response)
