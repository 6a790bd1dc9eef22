"""The server's OpenAPI document (`/openapi.json`), true to what the server does.

FastAPI's own document describes FastAPI's defaults, not this server: it lists 422 for a bad body
(this server answers 400 in OpenAI's error shape), no authentication, JSON for `/metrics`, nothing
for streams, and no schema for the generation routes' answers. This module starts from it and
writes in what the routes really answer, so that a client generated from it (or a fuzzer checking
responses against it, tests/server/test_openapi_fuzz.py) finds the server as documented:

- every error status a route can give (400, 401 with a key, 404, 408, 413, 503 with Retry-After, 504)
  with the error body's schema; never 422;
- the bearer scheme, on every route but /health, when `server.api_key` is set;
- `/metrics` as Prometheus text, `stream: true` answers as `text/event-stream`;
- the responses of /generate, /v1/completions, /v1/chat/completions, /v1/messages, /v1/responses
  and /v1/embeddings, and `sampling_params` (from `rxf.core.sampling_params.json_schema`: every
  field's type and range);
- Anthropic's error body and event stream on its routes (/v1/messages...), and its `x-api-key`
  header as the key's other scheme.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from rxf.entrypoints.anthropic import errors as anthropic_errors
from rxf.entrypoints.anthropic.protocol import MessageResponse
from rxf.entrypoints.http_errors import OPEN_PATHS
from rxf.entrypoints.openai.protocol import ChatCompletionResponse, CompletionResponse
from rxf.entrypoints.openai.responses_protocol import ResponseObject

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the field at fault, if one is"},
                "code": {"type": ["integer", "string"], "description": "the status, or a reason such as 'overloaded'"},
            },
        }
    },
}
_GENERATE_RESULT: dict[str, Any] = {
    "type": "object",
    "required": ["text", "output_ids", "meta_info"],
    "properties": {
        "text": {"type": "string"},
        "output_ids": {"type": "array", "items": {"type": "integer"}},
        "meta_info": {"type": "object", "description": "id, token counts, finish_reason, logprobs when asked"},
    },
}
_REASONS = {
    400: "invalid request: the message names the field and the reason",
    401: "missing or invalid API key",
    404: "no such model, or no such stored response",
    408: "the request's headers or body did not arrive within server.header_timeout_s / body_timeout_s",
    413: "the body exceeds server.max_body_bytes",
    503: "loading, shutting down, engine stopped, at capacity, or over server.max_connections (then Retry-After)",
    504: "the request ran past server.request_timeout_s",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
# Routes that can answer a stream (`"stream": true`): server-sent events, one JSON object per event.
_STREAMING = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"}
# Routes checking the body's `model` (or the path's model id) against the served one.
_MODEL_ROUTES = {
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/tokenize", "/v1/detokenize",
    "/tokenize", "/detokenize", "/v1/models/{model_id}", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/responses",
}
# Routes naming a stored response (the path's id, or `previous_response_id`): 404 when it is not stored.
_STORED_RESPONSE_ROUTES = {"/v1/responses", "/v1/responses/{response_id}"}
# Routes whose requests run in the engine, so past server.request_timeout_s.
_ENGINE_ROUTES = _STREAMING | {"/v1/embeddings"}


def _error(status: int, path: str) -> dict[str, Any]:
    schema = _ANTHROPIC_ERROR_REF if anthropic_errors.is_anthropic_path(path) else _ERROR_REF
    response: dict[str, Any] = {"description": _REASONS[status], "content": {"application/json": {"schema": schema}}}
    if status == 503:
        response["headers"] = _RETRY_AFTER
    return response


def _json(schema: dict[str, Any], description: str = "Successful Response") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _responses(path: str, op: dict[str, Any], with_key: bool) -> dict[str, Any]:
    responses = {code: r for code, r in op["responses"].items() if code != "422"}
    statuses = {408, 503}  # any route: the connection layer's read timeouts and connection cap
    if "requestBody" in op:
        statuses |= {400, 413}
    if with_key and path not in OPEN_PATHS:
        statuses.add(401)
    if path in _MODEL_ROUTES or path in _STORED_RESPONSE_ROUTES:
        statuses.add(404)
    if path in _ENGINE_ROUTES:
        statuses.add(504)
    if path in ("/flush_cache", "/start_profile", "/stop_profile"):
        statuses.add(400)  # refused while requests run; profiling off, or already (not) running
    responses |= {str(status): _error(status, path) for status in sorted(statuses)}
    return responses


def _success(path: str, ok: dict[str, Any]) -> dict[str, Any]:
    if path == "/metrics":
        return {"description": "Prometheus metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}
    if path == "/generate":
        ok = _json({"anyOf": [_GENERATE_RESULT, {"type": "array", "items": _GENERATE_RESULT}]},
                   "one result, or a list for a batch")
    elif path == "/v1/completions":
        ok = _json({"$ref": "#/components/schemas/CompletionResponse"})
    elif path == "/v1/chat/completions":
        ok = _json({"$ref": "#/components/schemas/ChatCompletionResponse"})
    elif path == "/v1/messages":
        ok = _json({"$ref": "#/components/schemas/MessageResponse"})
    elif path == "/v1/responses":
        ok = _json({"$ref": "#/components/schemas/ResponseObject"})
    if path in _STREAMING:
        events = "`data: {json}` events, then `data: [DONE]`"
        if anthropic_errors.is_anthropic_path(path):
            events = "`event: <type>` and `data: {json}` per event, from message_start to message_stop"
        elif path == "/v1/responses":
            events = "`event: <type>` and `data: {json}` per event, the last response.completed, .incomplete or .failed"
        # Each event, as an SSE parser gives it (and schemathesis validates it): its `data` field.
        event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
        sse = {"schema": event, "description": events}
        ok = {**ok, "content": {**ok["content"], "text/event-stream": sse}}
    return ok


def openapi_document(app: FastAPI, with_key: bool) -> dict[str, Any]:
    """The document of `app`; `with_key`: the server requires `server.api_key`."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _, responses = models_json_schema(
        [(ChatCompletionResponse, "serialization"), (CompletionResponse, "serialization"),
         (MessageResponse, "serialization"), (ResponseObject, "serialization")],
        ref_template="#/components/schemas/{model}",
    )
    schemas |= responses.get("$defs", {}) | {
        "ErrorResponse": ERROR_SCHEMA, "AnthropicErrorResponse": anthropic_errors.ERROR_SCHEMA,
    }
    for path, ops in doc["paths"].items():
        for op in ops.values():
            op["responses"] = _responses(path, op, with_key)
            op["responses"]["200"] = _success(path, op["responses"]["200"])
            if with_key and path in OPEN_PATHS:
                op["security"] = []  # probes need no key
    if with_key:  # either scheme carries the key
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc


def install_openapi(app: FastAPI, with_key: bool) -> None:
    """Serve `openapi_document` as the app's `/openapi.json` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, with_key)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
