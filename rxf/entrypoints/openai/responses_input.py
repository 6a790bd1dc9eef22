"""A Responses API request -> the chat request that serves it (`ChatCompletionRequest`), and the
chat layer's errors back in the Responses API's field names.

The conversation is: the `instructions` as a system message (never carried over from a previous
response, as OpenAI's), then the stored conversation of `previous_response_id`, then `input`.
Input items become chat messages: a message item its message (text parts joined into the
template's text parts, `input_image` an `image_url` part), consecutive `function_call` items the
`tool_calls` of one assistant turn, a `function_call_output` a `tool` message answering its call.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from rxf.entrypoints.openai.protocol import ChatCompletionRequest
from rxf.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    ImagePart,
    MessageItem,
    RefusalPart,
    ResponsesRequest,
    TextFormatJsonSchema,
)
from rxf.entrypoints.openai.sampling import bad_request
from rxf.entrypoints.server_state import APIError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The chat request's fields as the Responses request names them (an error's `param` and the head
# of its message).
_FIELD_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def check_responses(req: ResponsesRequest) -> None:
    """The Responses fields rxf refuses (the others translate or are accepted as no-ops)."""
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported (no stored conversations or prompts here)", name)
    if req.background:
        raise bad_request("background responses are not supported; use stream", "background")
    if req.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: an input over the context is refused", "truncation")
    if req.input is None and req.previous_response_id is None:
        raise bad_request("input is required (a string or a list of items)", "input")


def _part_text(part: Any, where: str) -> dict[str, Any]:
    if isinstance(part, RefusalPart):
        return {"type": "text", "text": part.refusal}
    if isinstance(part, ImagePart):
        if part.image_url is None:
            raise bad_request(f"{where}: an input_image needs an image_url (file_id is not supported)", "input")
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "text", "text": part.text}


def _message(item: MessageItem, where: str) -> dict[str, Any]:
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    return {"role": item.role, "content": [_part_text(p, f"{where}.content[{j}]") for j, p in enumerate(item.content)]}


def input_messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[int]]:
    """`input` as chat messages (OpenAI's shapes, as new dicts: a stored conversation's are never
    changed, other entries share them), and the index in `input` of each message's first item."""
    messages: list[dict[str, Any]] = []
    sources: list[int] = []
    for i, item in enumerate(req.input or []):
        if isinstance(item, MessageItem):
            messages.append(_message(item, f"input[{i}]"))
            sources.append(i)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same turn: its text, then its calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(i)
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            sources.append(i)
        # A reasoning item is not shown to the model again (chat templates drop earlier reasoning),
        # nor is a cut-off call (`CutOffCallItem`).
    return messages, sources


def message_sources(req: ResponsesRequest, history: list[dict[str, Any]], items: list[int]) -> list[str]:
    """Per message of the chat request (`chat_request`'s order), the Responses field it came from."""
    return (["instructions"] if req.instructions else []) + ["previous_response_id"] * len(history) + [
        f"input[{i}]" for i in items
    ]


def wants_logprobs(req: ResponsesRequest) -> bool:
    return req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or [])


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    if isinstance(fmt, TextFormatJsonSchema):
        return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}
    return {"type": fmt.type}


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]], model: str) -> ChatCompletionRequest:
    """The chat request serving `req`, whose `conversation` (chat messages: the previous response's
    conversation, then `input_messages(req)`) follows its instructions."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise bad_request("the conversation is empty: input holds no message", "input")
    tool_choice: Any = req.tool_choice
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in req.tools] if req.tools else None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "stream": req.stream,
        "user": req.user,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "logprobs": wants_logprobs(req),
        "top_logprobs": req.top_logprobs,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # the items were validated already: only the stored history can fail here
        raise bad_request(f"the conversation is not valid: {exc.errors()[0]['msg']}", "input") from None


def responses_error(error: APIError, sources: list[str]) -> APIError:
    """`error` (raised by the chat layer) naming the Responses request's field; `sources` are
    `message_sources`, so that "messages[3].content[0]: ..." reads "input[1].content[0]: ..."."""
    if error.param is None:
        return error
    head, bracket, rest = error.param.partition("[")
    name = _FIELD_NAMES.get(head)
    if name is None:
        return error
    param, message = f"{name}{bracket}{rest}", error.message
    at_message = re.match(r"messages\[(\d+)\]", message)
    if at_message and int(at_message[1]) < len(sources):
        # A tool message's `tool_call_id` is its function_call_output item's `call_id`.
        rest = re.sub(r"^\.tool_call_id\b", ".call_id", message[at_message.end():])
        message = sources[int(at_message[1])] + rest
        param = message.partition(": ")[0]
    elif message.startswith(head):
        message = name + message[len(head):]
    return APIError(error.status, message, type=error.type, param=param,
                    code=None if error.code == error.status else error.code, headers=error.headers)
