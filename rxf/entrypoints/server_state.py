"""What the HTTP routes share: the engine handles, readiness, and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from rxf.core.config import EngineConfig
from rxf.core.echo import cut
from rxf.core.frontend.tokenizer_manager import (
    EngineDeadError,
    OverloadedError,
    RequestError,
    RequestTimeoutError,
    TokenizerManager,
)
from rxf.entrypoints.json_route import LARGE_BODY_BYTES

logger = logging.getLogger(__name__)
T = TypeVar("T")
# The longest error message and `param` (a field's path) an error response carries.
MAX_MESSAGE_CHARS = 1000
MAX_PARAM_CHARS = 200


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self, status: int, message: str, *, type: str | None = None, param: str | None = None,
        code: str | int | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        # Bounded whatever the message quotes (each echo is bounded where it is written; this
        # holds for the ones that are not): an error never grows with the input it refuses.
        message = cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "server_error")
        self.param = None if param is None else cut(param, MAX_PARAM_CHARS)
        self.code = code if code is not None else status
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Seconds a client told "at capacity" or "shutting down" should wait before retrying.
RETRY_AFTER_S = 1


# A field as an engine error names it: `sampling_params.temperature`, `image_data[0]`.
_FIELD_PATH = re.compile(r"[A-Za-z_]\w*(\[\d+\])*(\.[A-Za-z_]\w*(\[\d+\])*)*")


def engine_api_error(exc: BaseException) -> APIError | None:
    """The HTTP answer to an exception the engine raises by design; None for anything else."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        message = str(exc)
        head, sep, _ = message.partition(":")  # messages read "field: reason" when one field is at fault
        param = head if sep and _FIELD_PATH.fullmatch(head) else None
        return APIError(400, message, param=param)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine stopped: {exc}")
    if isinstance(exc, OverloadedError):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestTimeoutError):
        # 504, not 408: the client sent its request in time; the server took too long to answer it.
        return APIError(504, str(exc), type="timeout_error", code="request_timeout")
    return None


_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    504: "timeout_error",
    503: "service_unavailable",
}


@dataclass
class ServerState:
    """Filled in by the server as the engine starts; `app.state.server` holds it."""

    config: EngineConfig
    served_model_name: str
    ready: bool = False
    startup_error: str | None = None
    engine_dead: str | None = None  # why a child process died after start-up; the server then answers 503
    draining: bool = False  # shutting down: requests in flight finish, new ones get 503
    engine: Any = None  # EngineProcesses
    tokenizer: Any = None
    chat_template: Any = None  # ChatTemplate
    tokenizer_manager: TokenizerManager | None = None
    metrics: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def require_ready(self) -> TokenizerManager:
        if self.startup_error:
            raise APIError(503, f"the engine failed to start: {self.startup_error}")
        if self.engine_dead:
            raise APIError(503, f"the engine stopped: {self.engine_dead}")
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_S)})
        if not self.ready or self.tokenizer_manager is None:
            raise APIError(503, "the model is still loading", headers={"Retry-After": "5"})
        return self.tokenizer_manager


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def server_registry(state: ServerState) -> Any:
    """The plugin registry of the server's process (its chat formats are looked up there), loaded
    once under the config's allow and deny lists."""
    if "registry" not in state.extra:
        from rxf.core.registry import PluginRegistry

        state.extra["registry"] = PluginRegistry.load(state.config.plugins.allow, state.config.plugins.deny)
    return state.extra["registry"]



async def prepare(request: Request, work: Callable[..., T], *args: Any, off_loop: bool = False) -> T:
    """`work(*args)`, in a thread when `off_loop` or the request's body is large or of unknown length
    (`LARGE_BODY_BYTES`: rendering thousands of messages or tokenizing a batch of long prompts would
    hold every other client for tenths of a second; a smaller body's work is cheaper inline than a
    thread hop). The work yields the GIL to the event loop every few milliseconds, or releases it,
    as the tokenizer does."""
    length = request.headers.get("content-length")
    if off_loop or length is None or not length.isdigit() or int(length) > LARGE_BODY_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` for a non-streaming response, cancelling it (which aborts its requests) if the
    client goes away first; None then. Call it once the body has been read: the next `receive()`
    message can then only be the disconnect. (Streaming responses need no help: Starlette cancels
    their iterator on a disconnect.)"""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its clean-up (the abort) runs before we return
    if task.cancelled():
        logger.info("client disconnected: request aborted")
        return None
    return task.result()
