"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request is translated into the chat request that /v1/chat/completions prepares (`translate`),
so its prompt, tools, limits and errors are the chat route's; the reply is read back as chat reads
it (reasoning, text, calls) into content blocks (`translate.reply_blocks`) or streamed as
Anthropic's events (`stream`). The `model` must be the served one (404 otherwise, as the OpenAI
routes); the `anthropic-version` and `anthropic-beta` headers are accepted and not read.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from rxf.entrypoints.anthropic import translate
from rxf.entrypoints.anthropic.errors import error_event
from rxf.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from rxf.entrypoints.anthropic.stream import message_events
from rxf.entrypoints.json_route import MsgspecJSONRoute, json_reply
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.sampling import check_model
from rxf.entrypoints.openai.serving_chat import ChatPlan, prepare_chat
from rxf.entrypoints.openai.sse import sse_response
from rxf.entrypoints.server_state import APIError, ServerState, prepare, server_state, until_disconnected

logger = logging.getLogger(__name__)
router = APIRouter(route_class=MsgspecJSONRoute)

# Chat fields an error may name -> the Messages API's field that set them.
_FIELD_NAMES = {"stop": "stop_sequences"}


async def _plan(request: Request, state: ServerState, body: MessagesRequest | CountTokensRequest) -> ChatPlan:
    check_model(body.model, state.served_model_name)
    try:
        takes_media = state.require_ready().preparer.mm_processor is not None
        # Off the event loop for a large body, as its planning: a walk of every message and block.
        chat = await prepare(request, translate.chat_request, body, takes_media)
        return await prepare_chat(request, state, chat)
    except APIError as exc:
        name = _FIELD_NAMES.get(exc.param or "")
        if name is None:
            raise
        raise APIError(exc.status, name + exc.message.removeprefix(exc.param or ""), param=name) from None


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> StreamingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    plan = await _plan(request, state, body)
    tm.check_capacity(len(plan.reqs))
    message_id = translate.new_message_id()
    model = state.served_model_name
    if body.stream:
        return sse_response(message_events(tm, plan, model, message_id, body.stop_sequences), error_event, end="")
    results = await until_disconnected(request, gen.collect(tm, plan.reqs))
    if results is None:
        return Response(status_code=499)  # the client left: its request was aborted, nobody reads this
    (result,) = results
    reply = plan.reply.split(result.text)
    reason, sequence = translate.stop_reason(result, bool(reply.calls), body.stop_sequences)
    return json_reply(MessageResponse(
        id=message_id, content=translate.reply_blocks(reply.reasoning, reply.content, reply.calls), model=model,
        stop_reason=reason, stop_sequence=sequence, usage=translate.usage(result),
    ))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """The prompt's tokens as /v1/messages would prefill them (tools, template and media included),
    counted by the one preparation every request gets: a prompt the model cannot take is a 400."""
    state = server_state(request)
    state.require_ready()
    plan = await _plan(request, state, body)
    return TokenCount(input_tokens=len(plan.prompt.input_ids))
