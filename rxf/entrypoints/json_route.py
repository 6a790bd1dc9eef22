"""Request bodies parsed by msgspec, and reply objects written by pydantic's own serializer: the JSON
of every route (FastAPI's own parse is the standard library's `json.loads`, on the event loop, while
every other client's requests wait; its own writing of a route without a `response_model` is slower
still, below).

msgspec decodes a million token ids in ~14 ms against ~56 for `json.loads` (the 2-core VM), so a
huge body holds the event loop that much less (`/health` beside a million-id detokenize:
tests/server/test_event_loop.py). A body msgspec refuses (malformed, not UTF-8, NaN or Infinity
literals, a number out of float range, a lone surrogate) is parsed by `json.loads` after all, so
what is accepted and every error message stay the standard library's.

A JSON body over `LARGE_BODY_BYTES` is also validated against the route's body model in a worker
thread, which FastAPI then finds done (validating a model instance again returns it as it is): a
7.8 MB chat body of 270k messages took 1.7 s of validation, every other client's requests waiting,
and holds the loop ~0.1 s at most from a thread (a hostile-input audit, 2026-12-07). Its errors are
FastAPI's own (`ModelField.validate`, the same locations), raised as FastAPI raises them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from fastapi._compat import ModelField

_decoder = msgspec.json.Decoder()
# Bodies above this are decoded and validated in a worker thread, and planned there
# (`server_state.prepare`).
LARGE_BODY_BYTES = 32 * 1024


class MsgspecJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = _decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._json = json.loads(body)
        return self._json

    async def validate_off_loop(self, field: ModelField) -> None:
        """When the body is JSON whose Content-Length is large, read it, decode it and validate it
        as `field` (the route's one body parameter) in a worker thread: `json()` then returns the
        model. Anything else is left to FastAPI as before: a small body or one of unknown length
        (chunked: the size limit cuts it while FastAPI reads it), another content type, a body that
        cannot be read or decoded, and any failure but the model's own errors (a body nested past
        the recursion limit: FastAPI's read says so)."""
        length = self.headers.get("content-length", "")
        media_type = self.headers.get("content-type", "").partition(";")[0].strip().lower()
        if not (length.isdigit() and int(length) > LARGE_BODY_BYTES) or not (
            media_type == "application/json" or media_type.endswith("+json")
        ):
            return
        try:
            body = await self.body()
        except StarletteHTTPException:  # the size limit's 413
            raise
        except Exception as exc:  # a client gone mid-body: answered as FastAPI's own read answers it
            raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc
        try:
            data = await asyncio.to_thread(_decoder.decode, body)
            value, errors = await asyncio.to_thread(field.validate, data, {}, loc=("body",))
        except Exception:  # noqa: BLE001 - left to FastAPI's own decoding and validation, on the loop
            return
        if errors:
            raise RequestValidationError(errors, body=data)
        self._json = value


class MsgspecJSONRoute(APIRoute):
    """An APIRoute whose handler reads the body through `MsgspecJSONRequest` (and validates a large
    one off the event loop, where the route has one body parameter)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        field = self.body_field if self.body_field is not None and not self._embed_body_fields else None

        async def route(request: Request) -> Response:
            request = MsgspecJSONRequest(request.scope, request.receive, request._send)
            if field is not None:
                await request.validate_off_loop(field)
            return await handler(request)

        return route


def json_text(body: BaseModel) -> str:
    """`body`'s JSON as `json_reply` writes it."""
    return body.model_dump_json(by_alias=True)


def json_reply(body: BaseModel | str) -> Response:
    """`body` (or its `json_text`) as a JSON reply, written by pydantic's serializer (aliases as
    FastAPI writes them).

    A route that may stream declares no `response_model`, and FastAPI then writes a returned model
    through `jsonable_encoder` (a Python walk of every field) and `json.dumps`: 1.6 s on the event
    loop for a reply with 4,096 tokens' 20 top logprobs, 0.28 s this way (the 2-core VM)."""
    return Response(body if isinstance(body, str) else json_text(body), media_type="application/json")
