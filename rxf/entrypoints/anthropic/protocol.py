"""Pydantic models of Anthropic's Messages API: the request bodies of /v1/messages and
/v1/messages/count_tokens, the message it answers and the stream's events.

Requests are validated as strictly as the OpenAI layer's (`RequestModel`: no "1" for 1, a JSON
null is the field left out, unknown fields ignored), so a wrong type is a 400 naming the field in
Anthropic's own names (`messages[0].content[1].source.data`). Ranges and engine capabilities are
checked once, when the translated chat request is prepared.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rxf.core.echo import echo
from rxf.entrypoints.chat.tools import check_json_schema
from rxf.entrypoints.openai.protocol import RequestModel

# Anthropic's own rule for tool names (within OpenAI's, which the chat path checks again).
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str  # cache_control and citations are ignored: the engine caches every prefix anyway


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(RequestModel):
    type: Literal["url"]
    url: str


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlock(RequestModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    """The result of an earlier call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(RequestModel):
    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        # Said here once: the union's own error would list every member's mismatch.
        if isinstance(value, list):
            for j, block in enumerate(value):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                    raise ValueError(f"content[{j}]: {echo(kind)} blocks are not supported; "
                                     f"blocks are {', '.join(_BLOCK_TYPES)}")
        return value


class ClientTool(RequestModel):
    """A client tool. Anthropic's server tools (web search, code execution, ...) carry another
    `type` and are refused: this server runs no tools itself."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _a_client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind is not None and kind != "custom":
            raise ValueError(f"{echo(kind)} tools (Anthropic's server tools) are not supported: give client tools "
                             "with a name and an input_schema")
        return data

    @field_validator("input_schema")
    @classmethod
    def _an_object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object'")
        check_json_schema(value)
        return value


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingOther(RequestModel):
    type: Literal["disabled", "adaptive"]


class _Conversation(RequestModel):
    """What messages and count_tokens share: the prompt."""

    _body = True
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ClientTool] | None = None
    tool_choice: ToolChoice | None = None  # None: auto
    # The template's thinking switch (`enable_thinking`): on when enabled, off when disabled or
    # left out (Anthropic's default), the template's own choice when adaptive. `budget_tokens` is
    # checked, not enforced (the reply's whole budget is `max_tokens`).
    thinking: Annotated[ThinkingEnabled | ThinkingOther, Field(discriminator="type")] | None = None


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # user_id: not used
    # The chat routes' extensions (vLLM's), honoured here too: a client that sends them expects them
    # (a salt silently ignored shares its prefixes with every tenant).
    cache_salt: str | None = None
    priority: int = 0


class CountTokensRequest(_Conversation):
    pass


# ---- responses ----


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # no signature: this server verifies no thinking sent back


BlockOut = Annotated[TextOut | ToolUseOut | ThinkingOut, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    """Anthropic's reading: the prompt is input_tokens + cache_read_input_tokens (the tokens found
    in the prefix cache); nothing costs extra to write into the cache, so cache_creation is 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[BlockOut]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int
