"""The connection layer of the HTTP server: uvicorn's h11 protocol with the limits a server that
faces clients it does not control needs, and that uvicorn lacks (`server.*` in the config):

- `header_timeout_s`: a request's headers must arrive within it, counted from the connection or,
  on a kept-alive one, from the next request's first byte (before that byte uvicorn's keep-alive
  timeout applies); `body_timeout_s`: its whole body within that after the headers. A request
  that misses either gets 408 (unless its answer has begun) and its connection is closed, so a
  client trickling headers or a body cannot hold a connection for long.
- `send_timeout_s`: a client that reads nothing of its answer for that long (the kernel's and the
  transport's buffers full, the answer's writes waiting) is disconnected; its request is then
  aborted like any other disconnect, so a stalled reader holds its KV and memory for at most that.
- `max_connections`: a connection opened beyond that many gets 503 + Retry-After on its requests
  and is closed, so connections cannot exhaust the process's file descriptors.

The read timeouts stop once a request has been read: a long streamed answer is never cut by them.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import resource
import time
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from rxf.core.config import ServerConfig
from rxf.entrypoints.http_errors import error_body, error_response
from rxf.entrypoints.server_state import RETRY_AFTER_S, APIError, ServerState

logger = logging.getLogger(__name__)

# File descriptors kept beside the client connections (engine sockets, model and tokenizer files).
_RESERVED_FDS = 512
# Seconds between two warnings that connections are refused (a flood would log each one).
_WARN_INTERVAL_S = 10.0


def _raw_response(error: APIError, path: str) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection, written past h11 (whose state may not
    allow a response: no request was read yet, or the app is still reading one). `path`: the
    request's, when known (its API's error shape)."""
    body = json.dumps(error_body(error, path)).encode()
    head = (
        f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _unavailable(message: str) -> APIError:
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})


class _RateLimitedWarning:
    def __init__(self) -> None:
        self.last = float("-inf")
        self.suppressed = 0

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < _WARN_INTERVAL_S:
            self.suppressed += 1
            return
        suffix = f" ({self.suppressed} more since the last warning)" if self.suppressed else ""
        logger.warning(message + suffix, *args)
        self.last, self.suppressed = now, 0


_warn_over_capacity = _RateLimitedWarning()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, a send deadline and a connection cap (module
    docstring). Built per connection by uvicorn, through `functools.partial(..., limits=...)`."""

    def __init__(self, *args: Any, limits: ServerConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_phase: str | None = None  # "headers" or "body": what the read timer waits for
        self._send_timer: asyncio.TimerHandle | None = None

    # ---- connection events ----
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:  # `connections` includes this one
            _warn_over_capacity("refusing requests: %d connections open, server.max_connections is %d",
                                len(self.connections), self.limits.max_connections)
            self.app = _OverCapacity(self.limits.max_connections)
        self._watch_reads(expecting=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_reads(expecting=True)  # a byte of a request came: its headers are now due

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Idle and kept alive: uvicorn's keep-alive timeout applies until a next request's bytes come
        # (already here when pipelined).
        self._watch_reads(expecting=bool(self.conn.trailing_data[0]))

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_read_phase(None)
        self._cancel_send_timer()
        super().connection_lost(exc)

    # ---- read deadlines ----
    def _watch_reads(self, expecting: bool) -> None:
        """Keep the read timer on what the client owes: headers (no request read yet, and one
        `expecting`), the body (their state SEND_BODY), or nothing (request read; answering)."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._set_read_phase("body")
        elif state is h11.IDLE and (expecting or self._read_phase == "headers"):
            self._set_read_phase("headers")
        else:
            self._set_read_phase(None)

    def _set_read_phase(self, phase: str | None) -> None:
        if phase == self._read_phase:
            return  # the deadline runs from when the phase began
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_phase = phase
        if phase is not None:
            limit = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
            self._read_timer = self.loop.call_later(limit, self._read_timed_out)

    def _read_timed_out(self) -> None:
        phase, self._read_phase, self._read_timer = self._read_phase, None, None
        if self.transport.is_closing():
            return
        limit = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
        field = "header_timeout_s" if phase == "headers" else "body_timeout_s"
        logger.info("closing the connection of %s: the request's %s did not arrive within server.%s = %s s",
                    _peer(self.client), phase, field, limit)
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            message = f"the request's {phase} did not arrive within server.{field} = {limit} s"
            error = APIError(408, message, type="timeout_error", code="request_timeout")
            self.transport.write(_raw_response(error, cycle.scope["path"] if cycle is not None else ""))
        if cycle is not None:  # the app reading the body sees a disconnect; its answer is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # ---- send deadline ----
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_timer()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        logger.info("disconnecting %s: it read nothing of its answer for server.send_timeout_s = %s s",
                    _peer(self.client), self.limits.send_timeout_s)
        self.transport.abort()  # close() would first wait to write what the client does not read


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class _OverCapacity:
    """The app of a connection opened beyond `server.max_connections`."""

    def __init__(self, max_connections: int) -> None:
        self.error = _unavailable(f"the server holds its maximum of {max_connections} connections; retry later")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(self.error, scope.get("path", ""))(scope, receive, send)


class DrainMiddleware:
    """While the server shuts down, every new request gets 503 + Retry-After and its connection is
    closed (a load balancer then sends the client elsewhere), while the requests in flight finish.
    `/metrics` still answers: monitoring sees the drain."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.error = _unavailable("the server is shutting down")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.state.draining and scope["path"] != "/metrics":
            await error_response(self.error, scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


def ensure_open_files(max_connections: int) -> None:
    """Raise the soft limit on open files (up to the hard one) to fit `max_connections` clients
    beside the engine's own descriptors, as vLLM and SGLang do; warn when the hard limit is lower."""
    wanted = max_connections + _RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning("the open-files limit (%d) is below server.max_connections + %d; connections past %d "
                       "will fail to open", soft, _RESERVED_FDS, soft - _RESERVED_FDS)
