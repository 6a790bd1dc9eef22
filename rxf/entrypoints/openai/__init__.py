"""The OpenAI-compatible API: a translation layer over the native generate request (DESIGN.md §7).

`router` holds every /v1 route; the HTTP server includes it and maps `APIError`, `RequestError`
and request-validation errors to OpenAI-shaped error responses.
"""

from __future__ import annotations

from fastapi import APIRouter

from rxf.entrypoints.json_route import MsgspecJSONRoute
from rxf.entrypoints.openai import (
    serving_chat,
    serving_completions,
    serving_embeddings,
    serving_models,
    serving_responses,
    tokenize,
)

router = APIRouter(route_class=MsgspecJSONRoute)
for _module in (serving_models, serving_completions, serving_chat, serving_responses, serving_embeddings, tokenize):
    router.include_router(_module.router)

__all__ = ["router"]
