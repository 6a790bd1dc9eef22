"""A Messages request's translation into the chat request, without an engine: what it refuses in
the Messages API's own terms, for /v1/messages and /v1/messages/count_tokens alike, and that a
large body is translated off the event loop (the server path is tests/server/test_anthropic_api.py)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from rxf.entrypoints.anthropic import serving_messages, translate
from rxf.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from rxf.entrypoints.json_route import LARGE_BODY_BYTES
from rxf.entrypoints.server_state import APIError

TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def request(counting: bool, **fields: Any) -> MessagesRequest | CountTokensRequest:
    body = {"model": "m", "messages": ASK} | fields
    return CountTokensRequest.model_validate(body) if counting else MessagesRequest.model_validate(body | {"max_tokens": 4})


@pytest.mark.parametrize("counting", [False, True], ids=["messages", "count_tokens"])
def test_tool_choice_must_name_an_offered_tool(counting):
    with pytest.raises(APIError) as info:
        translate.chat_request(request(counting, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), False)
    assert info.value.param == "tool_choice" and "'nope', which is not in tools" in info.value.message
    translate.chat_request(request(counting, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}), False)


@pytest.mark.parametrize("counting", [False, True], ids=["messages", "count_tokens"])
def test_a_final_assistant_tool_use_is_refused_in_messages_terms(counting):
    call = {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
                                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}
    with pytest.raises(APIError) as info:
        translate.chat_request(request(counting, tools=TOOLS, messages=[*ASK, call]), False)
    assert info.value.message.startswith("messages[1].content[1]: the final assistant message is the start of "
                                         "the reply"), info.value.message
    assert "continue_final_message" not in info.value.message


def test_a_large_body_is_translated_off_the_event_loop(monkeypatch):
    """270k empty messages take seconds to translate: not on the loop that answers every client."""
    seen: list[threading.Thread] = []

    def chat_request(body: Any, takes_media: bool) -> str:
        seen.append(threading.current_thread())
        return "chat"

    async def prepare_chat(request: Any, state: Any, chat: str) -> str:
        return chat

    monkeypatch.setattr(translate, "chat_request", chat_request)
    monkeypatch.setattr(serving_messages, "prepare_chat", prepare_chat)
    http_request = SimpleNamespace(headers={"content-length": str(LARGE_BODY_BYTES + 1)})
    state = SimpleNamespace(served_model_name="m",
                            require_ready=lambda: SimpleNamespace(preparer=SimpleNamespace(mm_processor=None)))
    plan = asyncio.run(serving_messages._plan(http_request, state, SimpleNamespace(model="m")))  # type: ignore[arg-type]
    assert plan == "chat" and seen and seen[0] is not threading.main_thread()
