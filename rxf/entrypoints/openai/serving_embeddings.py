"""POST /v1/embeddings: OpenAI's embeddings as native embedding requests (`GenerateRequest.embed`).

Each input (a string, or a list of token ids) becomes one native request, prepared once by the
engine's `RequestPreparer` (which refuses them on a generative model, and `dimensions` the model
cannot serve) and run concurrently; the scheduler pools, truncates and normalises, and sends each
vector as float32 little-endian bytes, which `encoding_format: "base64"` returns as they are.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rxf.core.frontend.outputs import GenerateOutput, embedding_floats
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import GenerateRequest
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.entrypoints.json_route import MsgspecJSONRoute
from rxf.entrypoints.openai import generation as gen
from rxf.entrypoints.openai.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from rxf.entrypoints.openai.sampling import bad_request, check_model, prepare_request
from rxf.entrypoints.server_state import prepare, server_state, until_disconnected

router = APIRouter(route_class=MsgspecJSONRoute)

_INPUT_FIELDS = {"text": "input", "input_ids": "input"}


def _inputs(given: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]  # type: ignore[list-item]
    if not given:
        raise bad_request("input must not be an empty list", "input")
    return list(given)  # type: ignore[arg-type]


def plan_embeddings(req: EmbeddingRequest, preparer: RequestPreparer) -> list[PreparedRequest]:
    """One prepared request per input, in order; raises APIError(400) naming the field. Blocking
    (tokenizing): run it off the event loop for a large body."""
    options = RequestOptions(dimensions=req.dimensions, normalize=req.normalize, priority=req.priority)
    rid = gen.new_id("embd")
    prepared = []
    for k, item in enumerate(_inputs(req.input)):
        text, ids = (item, None) if isinstance(item, str) else (None, item)
        native = GenerateRequest(text=text, input_ids=ids, options=options, rid=f"{rid}-{k}", embed=True)
        prepared.append(prepare_request(preparer, native, _INPUT_FIELDS))
    return prepared


def embedding_response(results: list[GenerateOutput], encoding_format: str, model: str) -> EmbeddingResponse:
    data = []
    for k, result in enumerate(results):
        assert result.embedding is not None  # every finished embedding request carries one
        vector: list[float] | str = (
            base64.b64encode(result.embedding).decode() if encoding_format == "base64"
            else embedding_floats(result.embedding)
        )
        data.append(Embedding(index=k, embedding=vector))
    tokens = sum(r.prompt_tokens for r in results)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse | Response:
    state = server_state(request)
    tm = state.require_ready()
    check_model(body.model, state.served_model_name)
    reqs = await prepare(request, plan_embeddings, body, tm.preparer)
    tm.check_capacity(len(reqs), param="input")
    results = await until_disconnected(request, gen.collect(tm, reqs))
    if results is None:
        return Response(status_code=499)  # the client left: its requests were aborted, nobody reads this
    return embedding_response(results, body.encoding_format, state.served_model_name)
