"""HTTP errors in the shape of the API a path belongs to (OpenAI's `{"error": {...}}`, or
Anthropic's under /v1/messages), the API-key check and the body size limit."""

from __future__ import annotations

import hmac
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rxf.core.frontend.tokenizer_manager import (
    EngineDeadError,
    OverloadedError,
    RequestError,
    RequestTimeoutError,
)
from rxf.entrypoints.anthropic import errors as anthropic_errors
from rxf.entrypoints.body_text import InvalidTextError
from rxf.entrypoints.server_state import APIError, engine_api_error

# Routes answered without the API key: load balancers and orchestrators probe them.
OPEN_PATHS = frozenset({"/health"})


def error_body(error: APIError, path: str) -> dict[str, Any]:
    """`error`'s body in the shape of the API that `path` belongs to."""
    return anthropic_errors.error_body(error) if anthropic_errors.is_anthropic_path(path) else error.body()


def error_response(error: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(error, path), status_code=error.status, headers=error.headers)


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _public_loc(loc: tuple[Any, ...], body: Any) -> tuple[Any, ...]:
    """A location in the request body as the client wrote it: without the union members' names
    that pydantic puts in it (`input[0].message.role` is `input[0].role`, `content.list[...][0]`
    is `content[0]`). A part that indexes the body there (a key of its object, an index of its
    array) is the client's; any other name is a member's, unless it ends the location at an
    object (a field left out). Once the body cannot be followed (a validator rewrote the value
    there) the rest is kept as it is."""
    public: list[Any] = []
    value, following = body, True
    for n, part in enumerate(loc):
        if following and isinstance(value, dict) and part in value:
            value = value[part]
        elif following and isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        elif following and isinstance(part, str) and (n < len(loc) - 1 or not isinstance(value, dict)):
            continue
        else:
            following = False
        public.append(part)
    return tuple(public)


def _field_loc(loc: tuple[Any, ...], body: Any) -> tuple[Any, ...]:
    """An error's location within the part of the request it is in."""
    if loc[:1] == ("body",):
        return _public_loc(loc[1:], body)
    return loc[1:] if loc[:1] in (("query",), ("path",), ("header",)) else loc


def _validation_error(errors: list[dict[str, Any]], body: Any = None) -> APIError:
    """One 400 for FastAPI's validation errors: `param` names the field (the part of the location
    that all of its errors share: a union type reports one error per member, and the deepest of
    them are told, those of the member the value was meant for)."""
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidTextError):  # raised by the body models' own validators
        return APIError(400, str(cause), param=cause.param or None)
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "JSON decode error")
        return APIError(400, f"malformed JSON body: {detail}")
    locs = [_field_loc(tuple(e.get("loc", ())), body) for e in errors]
    if not locs[0]:
        if first.get("type") == "missing":
            return APIError(400, "the request body is missing: expected a JSON object")
        if not isinstance(first.get("input"), dict | list | None):  # FastAPI read a non-JSON body as text
            return APIError(400, "the request body must be a JSON object sent as Content-Type: application/json")
        return APIError(400, f"the request body is invalid: {first.get('msg')}")
    same_field = [(loc, e) for loc, e in zip(locs, errors, strict=True) if loc[:1] == locs[0][:1]]
    deepest = max(len(loc) for loc, _ in same_field)
    same_field = [(loc, e) for loc, e in same_field if len(loc) == deepest]
    common = list(same_field[0][0])
    for loc, _ in same_field[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    param = _format_loc(tuple(common))
    reasons = list(dict.fromkeys(str(e.get("msg", "invalid")) for _, e in same_field))
    return APIError(400, f"{param}: {'; '.join(reasons)}", param=param)


def _body_parse_error(cause: BaseException) -> str:
    """Why FastAPI could not read a body that is not a JSON syntax error (those are `json_invalid`)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.start}): send JSON encoded as UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body nests JSON arrays or objects too deeply"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):  # Python's digit limit
        return f"the request body holds an integer of over {sys.get_int_max_str_digits()} digits"
    return f"the request body could not be read as JSON: {type(cause).__name__}"


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, APIError)
        return error_response(e, request.url.path)

    async def engine_error(request: Request, e: Exception) -> JSONResponse:
        error = engine_api_error(e)
        assert error is not None
        return error_response(error, request.url.path)

    async def validation(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, RequestValidationError)
        return error_response(_validation_error(list(e.errors()), e.body), request.url.path)

    async def http_error(request: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, StarletteHTTPException)
        message = str(e.detail)
        if e.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif e.status_code == 400 and e.__cause__ is not None:  # FastAPI's "error parsing the body"
            message = _body_parse_error(e.__cause__)
        return error_response(APIError(e.status_code, message, headers=e.headers), request.url.path)

    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises after this response, and uvicorn logs the traceback.
        return error_response(APIError(500, f"internal error: {type(e).__name__}"), request.url.path)

    app.add_exception_handler(APIError, api_error)
    for exc_type in (RequestError, EngineDeadError, OverloadedError, RequestTimeoutError):
        app.add_exception_handler(exc_type, engine_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


class APIKeyMiddleware:
    """Every route but OPEN_PATHS needs the key, as `Authorization: Bearer <key>` or as
    `x-api-key: <key>` (how Anthropic's clients send it); compared in constant time. A plain ASGI
    middleware (not BaseHTTPMiddleware), so streaming and disconnects pass untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        api_key = headers.get(b"x-api-key")
        scheme, _, token = auth.partition(b" ")
        bearer_ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        if bearer_ok or (api_key is not None and hmac.compare_digest(api_key.strip(), self.key)):
            await self.app(scope, receive, send)
            return
        reason = "missing API key" if not auth and api_key is None else "invalid API key"
        message = f"{reason}: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        error = APIError(401, message, headers={"WWW-Authenticate": "Bearer"})
        await error_response(error, scope["path"])(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`: at once when Content-Length says so, else
    as soon as the bytes received pass it (a chunked body has no Content-Length), so an oversized
    body is never held in memory in full."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"the request body exceeds server.max_body_bytes = {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._error(), scope["path"])(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException from reading the body through to the error
                    # handlers (any other exception there would become a generic 400).
                    raise StarletteHTTPException(413, self._error().message)
            return message

        await self.app(scope, limited_receive, send)
