"""Pydantic models of the Responses API (`/v1/responses`): the request body, the response object,
its output items and the stream's events, in the shapes of the `openai` SDK's `types/responses`.

Requests are validated as the chat models are (`protocol._Request`: strict, unknown fields
ignored, null = absent). Only what rxf serves is typed: function tools, message / function-call /
function-call-output / reasoning input items, text parts and images; anything else is a 400 naming
the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from rxf.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    FunctionCallIn,
    FunctionDefinition,
    JsonSchemaFormat,
    _Request,
)

# OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# A stored response echoes `user` and `text.format` (its description too, which the model never reads
# here): each is bounded, so that no request grows the response store by more than its conversation,
# which the context bounds. OpenAI documents 64 characters for `safety_identifier` and for
# `text.format`'s name, none for `user` and `prompt_cache_key` (ids of the same kind: hashes,
# session ids), which get the room of a native rid.
MAX_ID_CHARS = 64
MAX_LOOSE_ID_CHARS = 256
MAX_FORMAT_DESCRIPTION_CHARS = 1024

# ---- request ----


class TextPart(_Request):
    """`input_text` (user, system, developer, tool output) or `output_text` / `refusal` (an assistant
    turn sent back)."""

    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Request):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Request):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL (or http(s)/file where the server allows them)
    file_id: str | None = None  # refused: there is no Files API here
    detail: Literal["low", "high", "auto", "original"] = "auto"


ContentPart = Annotated[TextPart | RefusalPart | ImagePart, Field(discriminator="type")]


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(FunctionCallIn):
    """A call the model made (sent back with its output, as an agent loop does)."""

    type: Literal["function_call"]
    name: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    id: str | None = None
    status: str | None = None  # never "incomplete": that is a CutOffCallItem


class CutOffCallItem(_Request):
    """A call that `max_output_tokens` cut off, sent back as the response's output holds it: its
    arguments are what the model wrote of them. It is not shown to the model again (nothing can
    answer it; a stored response leaves it out of its conversation too)."""

    type: Literal["function_call"]
    status: Literal["incomplete"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningItemIn(_Request):
    """A reasoning item sent back; it is not shown to the model again (as OpenAI's chat-shaped
    models drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


def _item_type(value: Any) -> str:
    # A message may leave its type out (OpenAI's "easy input message").
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    status = value.get("status") if isinstance(value, dict) else getattr(value, "status", None)
    if kind == "function_call" and status == "incomplete":
        return "cut_off_call"
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CutOffCallItem, Tag("cut_off_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItemIn, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionDefinition):
    """A function tool, flat as the Responses API writes it (chat nests it under `function`)."""

    type: Literal["function"]


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJsonObject(_Request):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaFormat):
    type: Literal["json_schema"]
    name: str = Field(max_length=MAX_ID_CHARS)
    description: str | None = Field(None, max_length=MAX_FORMAT_DESCRIPTION_CHARS)


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; no model here reads it


class ReasoningConfig(_Request):
    """`effort` is the chat template's `reasoning_effort` (gpt-oss's reads it); `summary` is
    accepted and echoed (no summaries are written: the reasoning item holds the reasoning itself)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    _body = True

    model: str | None = None  # None: the served model
    input: list[InputItem] | None = None  # a string is read as one user message
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)  # OpenAI's least is 16; less still answers here
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None  # None: "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool = False
    user: str | None = Field(None, max_length=MAX_LOOSE_ID_CHARS)
    top_logprobs: int | None = None  # alternatives per output token (0 to 20): the logprobs are returned
    # "message.output_text.logprobs" returns the output's logprobs; the other values are accepted and
    # not acted on (they name OpenAI's hosted tools and encrypted reasoning).
    include: list[str] | None = None
    # Accepted and not acted on: they tune OpenAI's own service (caching, billing, safety).
    prompt_cache_key: str | None = Field(None, max_length=MAX_LOOSE_ID_CHARS)
    safety_identifier: str | None = Field(None, max_length=MAX_ID_CHARS)
    # The chat routes' extensions (vLLM's Responses API has them too): honoured, not ignored (a salt
    # silently ignored shares its prefixes with every tenant).
    cache_salt: str | None = None
    priority: int = 0
    service_tier: str | None = None
    # Refused whatever they hold: conversations and stored prompts live in OpenAI's platform.
    conversation: Any = None
    prompt: Any = None

    @field_validator("input", mode="before", json_schema_input_type=str | list[InputItem] | None)
    @classmethod
    def _text_is_a_user_message(cls, value: Any) -> Any:
        # Typed as the list it becomes, so that an error names the item at fault (`input[2].call_id`).
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > MAX_METADATA_PAIRS:
                raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
            if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items()):
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}")
        return value


# ---- response ----


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[ChatTokenLogprob] = []  # one per output token, when asked for


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOut(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOut(BaseModel):
    """The reply's reasoning (its reasoning parser's), ahead of the message."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = ReasoningOut | OutputMessage | FunctionCallOut


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the output tokens that wrote the reasoning item's text


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None  # None: cut short on request (an abort, a drain)


class ResponseErrorInfo(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    model: str
    output: list[OutputItem]
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    store: bool
    metadata: dict[str, str] = {}
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True
