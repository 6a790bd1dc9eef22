"""Pydantic models of the OpenAI-compatible API: request bodies, responses and stream chunks.

Requests are validated strictly (no "1" for 1, no `true` for an integer) so a wrong type is a 400
naming the field; unknown fields are ignored, and a JSON null means the same as leaving the field
out. Range checks and every engine capability live in the translation modules and the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rxf.entrypoints.body_text import check_unicode
from rxf.entrypoints.chat.tools import check_json_schema, check_schema_depth


def _omit_if_none() -> Any:
    return Field(default=None, exclude_if=lambda value: value is None)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # A whole request body: its text is checked once, here (the models nested in it are covered).
    _body: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Clients (and libraries wrapping them) send `"n": null` for "use the default".
        if isinstance(data, dict):
            if cls._body:
                check_unicode(data)
            return {key: value for key, value in data.items() if value is not None}
        return data


# The strict base of request bodies, shared with the other APIs' protocols (rxf.entrypoints.anthropic).
RequestModel = _Request


class StreamOptions(_Request):
    include_usage: bool = False


class GenerationFields(_Request):
    """What completions and chat share: sampling, streaming and the extension fields."""

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None  # tenant isolation in the prefix cache (as vLLM's)
    priority: int = 0  # vLLM's extension: lower runs first under scheduler.policy = "priority"
    # Extensions sent by benchmark tools and other servers' clients.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    min_tokens: int = 0
    lora_path: str | None = None
    # Structured output (SGLang's and vLLM's extension fields; at most one constraint per request).
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None  # a schema, or its JSON text
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # Typed loosely because they are refused whatever they hold.
    structural_tag: Any = None
    guided_choice: Any = None


class CompletionRequest(GenerationFields):
    _body = True
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: 16 (OpenAI's default), less if the context is shorter
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            decoded = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"arguments must be the JSON text of an object; it is not JSON: {exc}") from None
        if not isinstance(decoded, dict):
            raise ValueError(f"arguments must be the JSON text of an object, got a JSON {type(decoded).__name__}")
        return value


class ToolCallIn(_Request):
    """A call an assistant message made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    """One message; other keys (name, ...) reach the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    # A tool result answers one call: validated even when absent (validate_default), after `role`.
    tool_call_id: str | None = Field(None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not value:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return value


# A conversation: at least one message (a template renders nothing worth generating from none).
ChatMessages = Annotated[list[ChatMessage], Field(min_length=1)]


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is enforced either way

    @field_validator("schema_")
    @classmethod
    def _bounded_depth(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Checked here, before any work (the Responses API echoes it: pydantic refuses to write a
        # value nested past 255 levels); the grammar backend checks the rest when it compiles.
        check_schema_depth(value)
        return value


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not {self.type!r}")
        return self


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # As SGLang: every tool's schema is checked against JSON Schema's own (2020-12) schema,
        # whatever tool_choice is. Only a forced choice compiles it into a grammar: with "auto" it
        # is shown to the model, and a valid schema the grammar backend cannot compile still serves.
        if value is not None:
            check_json_schema(value)
        return value


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(GenerationFields):
    _body = True
    messages: ChatMessages
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens (OpenAI's newer name)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto"
    parallel_tool_calls: bool = True
    # vLLM's extension: the final assistant message is the reply's start, which the model continues.
    continue_final_message: bool = False
    # Variables for the chat template (e.g. {"enable_thinking": false}), as vLLM's and SGLang's.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # to the template


class TokenizeRequest(_Request):
    """vLLM's /tokenize body: a prompt or chat messages."""
    _body = True

    model: str | None = None
    prompt: str | None = None
    messages: ChatMessages | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    _body = True
    model: str | None = None
    tokens: list[int]


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls", "abort"]  # "abort": cut short on request


class CompletionLogprobs(BaseModel):
    """Parallel lists, one entry per token; `text_offset` indexes the choice's `text`."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_if_none()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = _omit_if_none()  # a thinking model's reasoning (vLLM's name)
    tool_calls: list[ToolCall] | None = _omit_if_none()


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = _omit_if_none()
    arguments: str | None = _omit_if_none()


class ToolCallDelta(BaseModel):
    """A streamed call: its first delta has id, type and name (arguments ""), later ones argument
    fragments; the fragments of one index concatenate to its arguments."""

    index: int
    id: str | None = _omit_if_none()
    type: Literal["function"] | None = _omit_if_none()
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = _omit_if_none()
    content: str | None = _omit_if_none()
    reasoning_content: str | None = _omit_if_none()
    tool_calls: list[ToolCallDelta] | None = _omit_if_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_if_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rxf"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = _omit_if_none()


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- /v1/embeddings ----


class EmbeddingRequest(_Request):
    _body = True
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 little-endian bytes
    dimensions: int | None = None  # keep the first that many values, then renormalise
    user: str | None = None
    # vLLM's extensions: L2-normalise or not (None: as the model's pooling config says); priority
    # as on the generation routes.
    normalize: bool | None = None
    priority: int = 0


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string for encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
