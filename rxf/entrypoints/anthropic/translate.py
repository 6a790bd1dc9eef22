"""Anthropic's Messages API <-> the chat path: a messages request becomes the OpenAI chat request
that `plan_chat` prepares (one validation, one tokenization, the same tools and grammars), and the
engine's reply becomes Anthropic's content blocks, stop reason and usage.

Messages: `system` (a string or text blocks, also a `system` role message) is the system message;
a user message's `tool_result` blocks become `tool` messages (in order, the blocks between them one
user message each); an assistant's `tool_use` blocks become its `tool_calls`; text and image blocks
become OpenAI content parts (an image as a data: URL, or its URL, for the multimodal path). Earlier
`thinking` blocks are dropped, as chat templates drop earlier reasoning. A final assistant message
is continued (`continue_final_message`). `thinking` sets the template's `enable_thinking`; the
reply's reasoning (the server's reasoning parser's) is its `thinking` block.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from rxf.core.echo import echo
from rxf.core.frontend.outputs import GenerateOutput
from rxf.entrypoints.anthropic.protocol import (
    BlockOut,
    ClientTool,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextBlock,
    TextOut,
    ThinkingEnabled,
    ThinkingOut,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from rxf.entrypoints.chat.tool_parsers import ParsedCall
from rxf.entrypoints.openai.protocol import ChatCompletionRequest
from rxf.entrypoints.server_state import APIError


def chat_request(req: MessagesRequest | CountTokensRequest, takes_media: bool) -> ChatCompletionRequest:
    """The chat request of `req`; image blocks are refused unless the model `takes_media`. For
    count_tokens, only the prompt: no budget and no forcing grammar (the prompt a forced choice
    shows is the one "auto" shows)."""
    counting = not isinstance(req, MessagesRequest)
    messages = _messages(req, takes_media)
    # A final assistant message is the start of the reply, which the model continues (a prefill).
    prefill = req.messages[-1].role == "assistant"
    if prefill:
        _check_prefill(req.messages[-1].content, f"messages[{len(req.messages) - 1}]")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "continue_final_message": prefill}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {"name": t.name, "parameters": t.input_schema}
             | ({"description": t.description} if t.description is not None else {})}
            for t in req.tools
        ]
        body |= _tool_choice(req.tool_choice, req.tools, counting)
    elif isinstance(req.tool_choice, ToolChoiceAny | ToolChoiceTool):  # "auto" and "none" mean no call either way
        raise APIError(400, f"tool_choice: {req.tool_choice.type!r} asks for a tool call, but the request has no tools",
                       param="tool_choice")
    if req.thinking is None or req.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"enable_thinking": isinstance(req.thinking, ThinkingEnabled)}
    if isinstance(req, MessagesRequest):
        optional = {"top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences}
        body |= {"max_tokens": req.max_tokens, "temperature": req.temperature, "stream": req.stream,
                 "cache_salt": req.cache_salt, "priority": req.priority}
        body |= {key: value for key, value in optional.items() if value is not None}
    else:
        body["max_tokens"] = 0  # only prefilled: counting asks the preparer for the prompt's tokens
    return ChatCompletionRequest.model_validate(body)


def _check_prefill(content: str | list[Any], where: str) -> None:
    """A final assistant message is continued: text to go on from, not a call (which a user
    message's tool_result answers)."""
    for j, block in enumerate(content if isinstance(content, list) else ()):
        if isinstance(block, ToolUseBlock):
            raise _bad(f"{where}.content[{j}]: the final assistant message is the start of the reply, which the "
                       "model continues: it cannot hold a tool_use block (answer it with a tool_result in a user "
                       "message)")


def _tool_choice(choice: Any, tools: list[ClientTool], counting: bool) -> dict[str, Any]:
    """The chat fields of `choice`. A tool it names must be offered, whether the request is counted
    or run (counting shows the prompt "auto" shows)."""
    if isinstance(choice, ToolChoiceTool) and choice.name not in {t.name for t in tools}:
        raise APIError(400, f"tool_choice: names the tool {echo(choice.name)}, which is not in tools",
                       param="tool_choice")
    if isinstance(choice, ToolChoiceNone):
        return {"tool_choice": "none"}
    if choice is None or counting:
        return {}
    parallel = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if isinstance(choice, ToolChoiceAny):
        return {"tool_choice": "required"} | parallel
    if isinstance(choice, ToolChoiceTool):
        return {"tool_choice": {"type": "function", "function": {"name": choice.name}}} | parallel
    return {"tool_choice": "auto"} | parallel


def _messages(req: MessagesRequest | CountTokensRequest, takes_media: bool) -> list[dict[str, Any]]:
    """Checked here, in the request's own indices (the chat messages are numbered otherwise)."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _parts(_numbered(req.system), "system", takes_media)})
    called: set[str] = set()  # the tool_use ids so far: each tool_result answers one of them
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}]"
        if msg.role == "assistant":
            out.append(_assistant(msg.content, where))
            called.update(call["id"] for call in out[-1].get("tool_calls") or ())
        elif msg.role == "system" or isinstance(msg.content, str):
            out.append({"role": msg.role, "content": _parts(_numbered(msg.content), where, takes_media)})
        else:
            out += _user(msg.content, where, takes_media, called)
    return out


def _bad(message: str) -> APIError:
    return APIError(400, message, param="messages")


def _numbered(content: str | list[Any]) -> str | list[tuple[int, Any]]:
    return content if isinstance(content, str) else list(enumerate(content))


def _parts(content: str | list[tuple[int, Any]], where: str, takes_media: bool) -> str | list[dict[str, Any]]:
    """Text and image blocks (with their index in the message) as OpenAI content parts; a string
    stays a string."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, block in content:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            if not takes_media:
                raise _bad(f"{where}.content[{j}]: images are not supported by this model")
            source = block.source
            url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _bad(f"{where}.content[{j}]: a {block.type} block is not allowed here")
    return parts


def _user(blocks: list[Any], where: str, takes_media: bool, called: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending: list[tuple[int, Any]] = []  # the blocks since the last tool result: one user message

    def flush() -> None:
        if pending:
            out.append({"role": "user", "content": _parts(pending, where, takes_media)})
            pending.clear()

    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in called:
                raise _bad(f"{where}.content[{j}]: tool_use_id {echo(block.tool_use_id)} answers no tool_use block "
                           f"of an earlier assistant message")
            flush()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, f"{where}.content[{j}]")})
        else:  # text and images (`_parts` refuses any other block)
            pending.append((j, block))
    flush()
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        return block.content
    if any(isinstance(part, ImageBlock) for part in block.content):
        raise _bad(f"{where}.content: images in tool results are not supported")
    return "\n".join(part.text for part in block.content)


def _assistant(content: str | list[Any], where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif block.type not in ("thinking", "redacted_thinking"):
            raise _bad(f"{where}.content[{j}]: a {block.type} block is not allowed in an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": texts or None}
    return message | ({"tool_calls": calls} if calls else {})


# ---- the reply ----


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(call: ParsedCall) -> dict[str, Any]:
    """A parsed call's arguments as the object Anthropic's `input` is (every parser and forcing
    grammar gives the JSON text of an object; anything else is kept under "arguments")."""
    try:
        value = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": call.arguments}


def reply_blocks(reasoning: str | None, content: str, calls: list[ParsedCall]) -> list[BlockOut]:
    """A whole reply's content blocks: its reasoning (None: none) as a thinking block, its text,
    then its calls."""
    blocks: list[BlockOut] = [ThinkingOut(thinking=reasoning)] if reasoning else []
    if content:
        blocks.append(TextOut(text=content))
    blocks += [ToolUseOut(id=new_tool_use_id(), name=c.name, input=tool_input(c)) for c in calls]
    return blocks


def stop_reason(out: GenerateOutput, called: bool, stop_sequences: list[str] | None) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished output. An abort asked for (the
    server's drain, /abort_request) has no stop reason in this API: it is a 503, which clients
    retry."""
    finish = out.finish_reason
    assert finish is not None
    if finish.type == "abort":
        raise APIError(503, "the request was aborted: the server is shutting down or it was cancelled")
    if finish.type == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(finish.matched, str) and finish.matched in (stop_sequences or ()):
        return "stop_sequence", finish.matched
    return "end_turn", None


def usage(out: GenerateOutput) -> MessageUsage:
    return MessageUsage(
        input_tokens=out.prompt_tokens - out.cached_tokens,
        output_tokens=out.completion_tokens,
        cache_read_input_tokens=out.cached_tokens,
    )
