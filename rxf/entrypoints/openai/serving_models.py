"""GET /v1/models and /v1/models/{id}: the one model this server serves.

Both need the engine ready (503 while loading), so clients that poll /v1/models before sending
requests wait for the model rather than for the HTTP server alone.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from rxf.entrypoints.json_route import MsgspecJSONRoute
from rxf.entrypoints.openai.protocol import ModelCard, ModelList
from rxf.entrypoints.openai.sampling import check_model
from rxf.entrypoints.server_state import ServerState, server_state

router = APIRouter(route_class=MsgspecJSONRoute)

# OpenAI's `created` is when the model was made; here, when this server process started.
_STARTED = int(time.time())


def model_card(state: ServerState) -> ModelCard:
    tm = state.require_ready()
    return ModelCard(
        id=state.served_model_name,
        created=_STARTED,
        root=str(state.config.model.path),
        max_model_len=tm.max_context_len,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[model_card(server_state(request))])


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    state = server_state(request)
    card = model_card(state)
    check_model(model_id, state.served_model_name)
    return card
