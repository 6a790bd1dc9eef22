"""Request bodies parsed by msgspec: every route's JSON body (FastAPI's own parse is the standard
library's `json.loads`, on the event loop, while every other client's requests wait).

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
