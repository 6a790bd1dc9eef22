"""Request bodies parsed by msgspec, and reply objects written by pydantic's own serializer: the JSON
of every route (FastAPI's own parse is the standard library's `json.loads`, on the event loop, while
every other client's requests wait; its own writing of a route without a `response_model` is slower
still, below).

msgspec decodes a million token ids in ~14 ms against ~56 for `json.loads` (the 2-core VM), so a
huge body holds the event loop that much less (`/health` beside a million-id detokenize:
tests/server/test_event_loop.py). A body msgspec refuses (malformed, not UTF-8, NaN or Infinity
literals, a number out of float range, a lone surrogate) is parsed by `json.loads` after all, so
what is accepted and every error message stay the standard library's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

_decoder = msgspec.json.Decoder()


class MsgspecJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = _decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._json = json.loads(body)
        return self._json


class MsgspecJSONRoute(APIRoute):
    """An APIRoute whose handler reads the body through `MsgspecJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(MsgspecJSONRequest(request.scope, request.receive, request._send))

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
