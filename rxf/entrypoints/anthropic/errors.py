"""Errors in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`, the
status kept, the error type Anthropic gives that status. Every route under `PATH_PREFIX` answers
its errors this way (the server's handlers and middlewares ask `is_anthropic_path`); a stream
reports a failure after its headers as an `error` event, which the `anthropic` SDK raises."""

from __future__ import annotations

import json
from typing import Any

from rxf.entrypoints.server_state import APIError

PATH_PREFIX = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # loading, draining, at capacity: worth a retry, as Anthropic's 529
    504: "timeout_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def error_event(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(error_body(error))}\n\n"


# The error body's schema, for the OpenAPI document.
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
