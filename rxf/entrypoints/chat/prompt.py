"""A chat request's prompt: messages (with offered tools) rendered, and their media collected, as the
native request that the RequestPreparer then tokenizes and checks with every other request;
`response_format` as a native constraint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rxf.core.chat_template import PART_SEPARATOR
from rxf.core.echo import echo
from rxf.core.frontend.requests import GenerateRequest
from rxf.core.ipc.messages import RequestOptions
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.messages import render_messages, template_messages
from rxf.entrypoints.chat.tool_parsers import ToolCallParser
from rxf.entrypoints.chat.tools import ToolPlan

# response_format json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# The native request's prompt fields as a chat request names them (`RequestError.renamed`): the
# prompt is the messages, and a media error names the image or video inside them.
PROMPT_FIELDS = {"text": "messages", "image_data": "messages: image", "video_data": "messages: video"}
# Names rendering itself sets, or that transformers' apply_chat_template takes as its own arguments:
# a request's template variables may not replace them.
RESERVED_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "chat_template", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
})


@dataclass
class ChatPrompt:
    text: str  # the rendered conversation: it holds its special tokens (none are added to it)
    images: list[Any] | None  # the media of its placeholders, in order (None: the model takes none)
    videos: list[Any] | None

    def request(
        self, params: dict[str, Any], options: RequestOptions, rid: str | None, default_max_new_tokens: int | None
    ) -> GenerateRequest:
        """The native request of this prompt."""
        return GenerateRequest(
            text=self.text, add_special_tokens=False, image_data=self.images, video_data=self.videos,
            sampling_params=params, options=options, rid=rid, default_max_new_tokens=default_max_new_tokens,
        )


def build_chat_prompt(
    messages: list[dict[str, Any]],
    chat_template: Any,
    tool_parser: ToolCallParser | None,
    tools: ToolPlan | None = None,
    takes_media: bool = False,
    continue_final: bool = False,
    variables: dict[str, Any] | None = None,
) -> ChatPrompt:
    """The prompt of `messages` offering `tools`, the template given `variables` (see
    `template_variables`); media parts are refused unless the model `takes_media` (has a
    multimodal processor). `continue_final`: the last message is the start of the assistant's
    reply, which the model continues (the conversation before it is rendered up to the assistant's
    turn, and that text follows, with no end of turn)."""
    images: list[Any] | None = [] if takes_media else None
    videos: list[Any] | None = [] if takes_media else None
    offered = tools.tools if tools is not None else None
    if variables:
        chat_template = chat_template.with_variables(variables)
    items = template_messages(messages, images, videos)
    start = ""
    if continue_final:
        start, items = _reply_start(items), items[:-1]
    text = render_messages(items, chat_template, tool_parser, offered) + start
    return ChatPrompt(text, images, videos)


def _reply_start(items: list[dict[str, Any]]) -> str:
    """The text of the final message, which must be an assistant's text (no calls, no media)."""
    last = items[-1]
    content = last.get("content") or ""
    parts = [content] if isinstance(content, str) else content
    if last["role"] != "assistant" or last.get("tool_calls") or any(
        not isinstance(p, str) and p.get("type") != "text" for p in parts
    ):
        raise ChatInputError(
            "continue_final_message needs the last message to be an assistant's text, without tool calls or media",
            "messages",
        )
    if len(items) == 1:  # the conversation it continues would be empty, which no template renders
        raise ChatInputError("continue_final_message needs a message before the assistant's final one", "messages")
    return PART_SEPARATOR.join(p if isinstance(p, str) else str(p.get("text", "")) for p in parts)


def response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, str]:
    """The native constraint of a (validated) `response_format`: `{"json_schema": <text>}` for
    json_object and json_schema, `{}` for text or none."""
    kind = response_format.get("type") if response_format else None
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        return {"json_schema": json.dumps(response_format["json_schema"]["schema"])}
    return {}


def template_variables(chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any]:
    """The template variables of a request: its `chat_template_kwargs` (e.g. `enable_thinking`)
    and `reasoning_effort` (which gpt-oss's template reads; it wins over a kwarg of that name).
    Raises ChatInputError for a name that is no identifier or that rendering sets itself."""
    variables = dict(chat_template_kwargs or {})
    for name in variables:
        if not name.isidentifier() or name in RESERVED_VARIABLES:
            reason = "is set by the server" if name in RESERVED_VARIABLES else "is not a template variable name"
            raise ChatInputError(f"chat_template_kwargs: {echo(name)} {reason}", "chat_template_kwargs")
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
    return variables
