"""Server-sent events as OpenAI streams them: `data: {json}` events, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from rxf.entrypoints.server_state import APIError, engine_api_error
from rxf.entrypoints.sse_lines import data_json

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def to_api_error(exc: Exception) -> APIError | None:
    """The API error for an exception raised by design; None for anything else."""
    return engine_api_error(exc)


def event(payload: BaseModel) -> str:
    return f"data: {data_json(payload.model_dump_json())}\n\n"


def error_event(error: APIError) -> str:
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return f"data: {json.dumps(body)}\n\n"


async def _with_errors(
    events: AsyncGenerator[str, None], on_error: Callable[[APIError], str], end: str
) -> AsyncGenerator[str, None]:
    """Once the 200 headers are out, a failure can only be reported in the stream: as an error
    event (which the client raises), then `end`. Cancellation is not caught: it must reach
    the engine requests so they are aborted."""
    try:
        async for item in events:
            yield item
    except Exception as exc:
        error = to_api_error(exc)
        if error is None:
            logger.exception("stream failed")
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        yield on_error(error)
    finally:
        await events.aclose()  # closing it closes the engine requests under it
    if end:
        yield end


def sse_response(
    events: AsyncGenerator[str, None], on_error: Callable[[APIError], str] = error_event, end: str = DONE
) -> StreamingResponse:
    """`events` must not yield `end` itself (OpenAI's [DONE]; "" for none); it is added after the
    last event. A failure while streaming becomes the event `on_error` writes."""
    return StreamingResponse(
        _with_errors(events, on_error, end),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
