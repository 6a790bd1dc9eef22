"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A translation over the chat path: the request becomes a `ChatCompletionRequest`
(`responses_input`), planned by `serving_chat.plan_chat` (the chat template, tools, the output
constraint, one prepared native request) and run as chat runs it; its result becomes the response
object (`responses_output`) or its events (`responses_stream`). With `store` (the default) the
finished response is kept (`responses_store`) for retrieval and for `previous_response_id`, which
continues its conversation.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from rxf.core.echo import echo
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.entrypoints.chat.reasoning import ReasoningParser
from rxf.entrypoints.chat.tool_parsers import ToolCallParser
from rxf.entrypoints.json_route import MsgspecJSONRoute, json_reply, json_text
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.logprobs import TokenStr, token_str_fn
from rxf.entrypoints.openai.responses_input import (
    chat_request,
    check_responses,
    input_messages,
    message_sources,
    responses_error,
)
from rxf.entrypoints.openai.responses_output import (
    ResponsePlan,
    final_response,
    new_item_id,
    stored_conversation,
)
from rxf.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    ImagePart,
    ResponseObject,
    ResponsesRequest,
)
from rxf.entrypoints.openai.responses_store import ResponseStore
from rxf.entrypoints.openai.responses_stream import response_events
from rxf.entrypoints.openai.sampling import check_model
from rxf.entrypoints.openai.serving_chat import plan_chat, reasoning_parser, tool_parser
from rxf.entrypoints.openai.sse import sse_response
from rxf.entrypoints.server_state import APIError, ServerState, prepare, server_state, until_disconnected

router = APIRouter(route_class=MsgspecJSONRoute)


def response_store(state: ServerState) -> ResponseStore:
    """The server's store of responses, made once from `server.responses_store_*`."""
    store = state.extra.get("responses_store")
    if store is None:
        server = state.config.server
        store = state.extra["responses_store"] = ResponseStore(
            server.responses_store_entries, server.responses_store_ttl_s, server.responses_store_max_mb * 10**6
        )
    return store


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"no response with id {echo(response_id)}: it was never stored, was deleted or expired",
                    type="invalid_request_error", param=param, code="response_not_found")


def plan_response(
    req: ResponsesRequest,
    history: list[dict[str, Any]],
    preparer: RequestPreparer,
    chat_template: Any,
    parser: ToolCallParser,
    reasoning: ReasoningParser | None,
    model: str,
    token_str: TokenStr,
) -> ResponsePlan:
    """The plan of `req` continuing the conversation `history`; raises APIError(400) naming the
    Responses field. Blocking (as `plan_chat`): run it off the event loop when it may be slow."""
    messages, items = input_messages(req)
    conversation = history + messages
    try:
        chat = plan_chat(chat_request(req, conversation, model), preparer, chat_template, parser, reasoning)
    except APIError as exc:
        raise responses_error(exc, message_sources(req, history, items)) from None

    skip_special_tokens = reasoning is None or not reasoning.needs_special_tokens  # as `plan_chat` asks

    def decode(ids: list[int]) -> str:
        return preparer.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    return ResponsePlan(new_item_id("resp"), req, chat, conversation, model, decode,
                        token_str if chat.logprobs else None)


def _slow_to_plan(req: ResponsesRequest, takes_media: bool) -> bool:
    """Whether planning compiles a constraint (a forced tool, a JSON format) or decodes images."""
    forced_tools = bool(req.tools) and req.tool_choice not in (None, "none", "auto")
    fmt = req.text.format if req.text is not None else None
    images = takes_media and any(
        isinstance(part, ImagePart) for item in req.input or [] if isinstance(getattr(item, "content", None), list)
        for part in item.content  # type: ignore[union-attr]
    )
    return forced_tools or (fmt is not None and fmt.type != "text") or images


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> StreamingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    check_responses(body)
    store = response_store(state)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    slow = _slow_to_plan(body, tm.preparer.mm_processor is not None)
    plan = await prepare(request, plan_response, body, history, tm.preparer, state.chat_template, tool_parser(state),
                         reasoning_parser(state), state.served_model_name, token_str_fn(state.tokenizer), off_loop=slow)
    tm.check_capacity(len(plan.chat.reqs))

    def keep(response: ResponseObject, text: str | None = None) -> None:
        if body.store:
            store.put(response.id, text or json_text(response), stored_conversation(plan, response))

    if body.stream:
        # The events tell an engine failure themselves (response.failed); no [DONE] ends them.
        return sse_response(response_events(tm, plan, keep), end="")
    try:
        results = await until_disconnected(request, gen.collect(tm, plan.chat.reqs, plan.chat.names))
    except APIError as exc:  # the engine's abort of a constraint names the chat field: say this request's
        raise responses_error(exc, []) from None
    if results is None:
        return Response(status_code=499)  # the client left: its request was aborted, nobody reads this
    # Off the event loop: counting the reasoning's tokens decodes the output a few times.
    response = await asyncio.to_thread(final_response, plan, results[0])
    text = json_text(response)  # once: the reply and the stored copy
    keep(response, text)
    return json_reply(text)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(response_id: str, request: Request) -> Response:
    stored = response_store(server_state(request)).get(response_id)
    if stored is None:
        raise _not_found(response_id, None)
    return json_reply(stored.response_json)


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    if not response_store(server_state(request)).delete(response_id):
        raise _not_found(response_id, None)
    return DeletedResponse(id=response_id)
