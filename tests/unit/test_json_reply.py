"""`json_reply` writes a reply object as FastAPI would (`jsonable_encoder`, the reference): the same
JSON value, with fields excluded when None (`exclude_if`), logprob dicts, nulls and non-ASCII text."""

from __future__ import annotations

import json

import pytest
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel

from rxf.entrypoints.anthropic.protocol import MessageResponse
from rxf.entrypoints.json_route import json_reply, json_text
from rxf.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse
from rxf.entrypoints.openai.responses_protocol import ResponseObject

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
TOP = {"token": "é", "logprob": -0.25, "bytes": [195, 169]}
REPLIES = [
    ChatCompletionResponse.model_validate({
        "id": "chatcmpl-1", "created": 1, "model": "m", "usage": USAGE, "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"content": "Paris ☃", "reasoning_content": None},
             "logprobs": {"content": [{**TOP, "top_logprobs": [TOP, {**TOP, "logprob": -9999.0}]}]}},
            {"index": 1, "finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
                {"id": "call_1", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]}),
    CompletionResponse.model_validate({
        "id": "cmpl-1", "created": 1, "model": "m", "usage": USAGE, "choices": [
            {"index": 0, "text": "ab", "finish_reason": "length", "logprobs": {
                "tokens": ["a", "b"], "token_logprobs": [None, -1.5], "top_logprobs": [None, {"b": -1.5, "c": -2e-07}],
                "text_offset": [0, 1]}}]}),
    ResponseObject.model_validate({
        "id": "resp_1", "created_at": 1, "status": "completed", "model": "m", "temperature": 1.0, "top_p": 1.0,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto",
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "store": True, "metadata": {"k": "v"},
        "output": [{"id": "msg_1", "status": "completed", "content": [{"text": "hi", "logprobs": [
            {**TOP, "top_logprobs": [TOP]}]}]}]}),
    MessageResponse.model_validate({
        "id": "msg_1", "model": "m", "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 2},
        "content": [{"type": "text", "text": "hi"}]}),
]


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_a_reply_is_the_json_fastapi_would_write(reply: BaseModel):
    response = json_reply(reply)
    assert response.media_type == "application/json"
    assert json.loads(response.body) == jsonable_encoder(reply)
    assert json_reply(json_text(reply)).body == response.body
