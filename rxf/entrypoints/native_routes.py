"""Native routes: SGLang-compatible `/generate`, health, model/server info, cache and abort, metrics.

`/generate` takes `text` or `input_ids`, each a single prompt or a list (a batch answers a list);
per-prompt options may be a single value or a list. A stream answers SSE `data: {json}` chunks,
each holding the result so far (cumulative `text`, `output_ids` and logprobs, as SGLang's
`/generate` does), then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from rxf.core import sampling_params
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import (
    MAX_CACHE_SALT_LEN,
    MAX_RID_LEN,
    MAX_TOP_LOGPROBS,
    PRIORITY_RANGE,
    GenerateRequest,
)
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.entrypoints.body_text import check_unicode
from rxf.entrypoints.json_route import MsgspecJSONRoute
from rxf.entrypoints.server_state import (
    APIError,
    ServerState,
    engine_api_error,
    prepare,
    server_state,
    until_disconnected,
)
from rxf.entrypoints.sse_lines import data_json

logger = logging.getLogger(__name__)

router = APIRouter(route_class=MsgspecJSONRoute)
State = Annotated[ServerState, Depends(server_state)]
# /health_generate gives up after this long (the engine is then too busy or stuck: 503).
HEALTH_GENERATE_TIMEOUT_S = 30.0


class _NativeBody(BaseModel):
    """Strict types (no "yes" for true, no "5" for 5), so a wrong type is a 400 naming the field;
    every string must be valid Unicode (`check_unicode`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_unicode(data)
        return data


# A `sampling_params` object: parsed and range-checked by the RequestPreparer (every front door's one
# validation), documented by its JSON schema.
SamplingParamsObject = Annotated[dict[str, Any], WithJsonSchema(sampling_params.json_schema())]


def _documented(default: int, bound: tuple[int, int], description: str) -> Any:
    """A field's range for the document only: the RequestPreparer checks it, for every front door."""
    return Field(default, json_schema_extra={"minimum": bound[0], "maximum": bound[1]}, description=description)


class GenerateBody(_NativeBody):
    """The body of POST /generate. Unknown fields are ignored, as SGLang's clients send extras."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsObject | list[SamplingParamsObject] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = Field(-1, description="-1: output tokens only; else a prompt position")
    top_logprobs_num: int | list[int] = _documented(0, (0, MAX_TOP_LOGPROBS), "alternatives per token")
    rid: str | list[str] | None = Field(None, description=f"at most {MAX_RID_LEN} characters, unique among running requests")
    cache_salt: str | list[str] | None = Field(None, description=f"1 to {MAX_CACHE_SALT_LEN} characters")
    priority: int | list[int] = _documented(0, PRIORITY_RANGE, "lower runs first; one for all prompts or one each")
    # One prompt: an image (base64 / data: URL / allowed URL or path) or a list of them, one per
    # <image> placeholder; a batch: a list with one such entry per prompt. Videos: lists of frames.
    image_data: Any = None
    video_data: Any = None


_NOT_BODY_OPTIONS = {"stream", "dimensions", "normalize"}


class AbortBody(_NativeBody):
    rid: str = Field(max_length=MAX_RID_LEN)  # no running request has a longer one; the answer echoes it


class StartProfileBody(_NativeBody):
    num_steps: int | None = Field(None, gt=0, description="steps after which the profile stops itself")
    kernels: bool = Field(False, description="add torch.profiler's kernel trace (for short windows)")


def _per_item(name: str, value: Any, n: int, batched: bool) -> list[Any]:
    if isinstance(value, list):
        if not batched or len(value) != n:
            raise APIError(400, f"{name}: a list needs a batch of the same length ({n} prompts)", param=name)
        return value
    return [value] * n


def _requests(body: GenerateBody) -> tuple[list[GenerateRequest], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text")
    if body.text is not None:
        batched = isinstance(body.text, list)
        items: list[dict[str, Any]] = [{"text": t} for t in (body.text if batched else [body.text])]
    else:
        ids = body.input_ids or []
        batched = bool(ids) and isinstance(ids[0], list)
        items = [{"input_ids": i} for i in (ids if batched else [ids])]
    if batched and not items:
        raise APIError(400, "the batch is empty", param="text" if body.text is not None else "input_ids")
    if batched and body.stream:
        raise APIError(400, "stream: streaming takes a single prompt, not a batch", param="stream")
    n = len(items)
    # Each option of the body, per prompt (`stream` is one for the whole body; the embedding
    # options are for the requests of /v1/embeddings and Runtime.embed).
    options = {
        f.name: _per_item(f.name, getattr(body, f.name), n, batched)
        for f in fields(RequestOptions) if f.name not in _NOT_BODY_OPTIONS
    }
    params = _per_item("sampling_params", body.sampling_params, n, batched)
    if batched and isinstance(body.rid, str):
        raise APIError(400, "rid: a batch needs a list of request ids, one per prompt", param="rid")
    rids = _per_item("rid", body.rid, n, batched)
    media = {}
    for name in ("image_data", "video_data"):
        value = getattr(body, name)
        if batched and value is not None and not (isinstance(value, list) and len(value) == n):
            raise APIError(400, f"{name}: a batch needs a list with one entry per prompt ({n})", param=name)
        media[name] = value if batched and value is not None else [value] * n
    reqs = [
        GenerateRequest(
            **item, sampling_params=params[i], rid=rids[i], image_data=media["image_data"][i],
            video_data=media["video_data"][i],
            options=RequestOptions(stream=body.stream, **{k: v[i] for k, v in options.items()}),
        )
        for i, item in enumerate(items)
    ]
    return reqs, batched


def _prepare_all(preparer: RequestPreparer, reqs: list[GenerateRequest]) -> list[PreparedRequest]:
    return [preparer.prepare(r) for r in reqs]


async def _one(tm: TokenizerManager, req: PreparedRequest) -> dict[str, Any]:
    results = [r async for r in tm.generate(req)]  # a non-streaming request yields one result
    return results[-1].to_dict()


async def _all(tm: TokenizerManager, reqs: list[PreparedRequest]) -> list[dict[str, Any]]:
    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels (aborts) the others
            tasks = [group.create_task(_one(tm, r)) for r in reqs]
    except BaseExceptionGroup as eg:  # answer with the first failure, as a single request would
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


def _sse(obj: Any) -> str:
    return f"data: {data_json(json.dumps(obj, ensure_ascii=False))}\n\n"


_CUMULATIVE = ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs")


class _CumulativeList:
    """A list that a stream's every chunk sends whole (SGLang's cumulative chunks), kept as its JSON
    text: each chunk serialises only its new entries. Serialising the whole list each time cost
    time quadratic in the output (1,000 tokens with 20 top logprobs: 235 MB of JSON written on the
    event loop, which every other client waits for); the bytes sent stay quadratic, the client's
    own choice."""

    def __init__(self) -> None:
        self.json = ""  # the entries, comma-separated, without the brackets

    def extend(self, entries: list[Any]) -> str:
        if entries:
            more = data_json(json.dumps(entries, ensure_ascii=False))[1:-1]
            self.json = f"{self.json},{more}" if self.json else more
        return f"[{self.json}]"


async def _stream(tm: TokenizerManager, req: PreparedRequest) -> AsyncIterator[str]:
    """Cumulative chunks. A failure after the headers went out is reported as an error event."""
    text = ""
    ids, lists = _CumulativeList(), {key: _CumulativeList() for key in _CUMULATIVE}
    agen = tm.generate(req)
    try:
        async for out in agen:
            chunk = out.to_dict()
            text += chunk["text"]
            meta = dict(chunk["meta_info"])
            # A list first sent with one chunk (the prompt's logprobs) is sent again with each later one.
            grown = {key: lists[key].extend(meta.pop(key, [])) for key in _CUMULATIVE
                     if key in chunk["meta_info"] or lists[key].json}
            meta_json = data_json(json.dumps(meta, ensure_ascii=False))[:-1]  # the object, open for the lists
            meta_json += "".join(f', "{key}": {value}' for key, value in grown.items()) + "}"
            head = data_json(json.dumps({"text": text}, ensure_ascii=False))[:-1]
            yield f'data: {head}, "output_ids": {ids.extend(chunk["output_ids"])}, "meta_info": {meta_json}}}\n\n'
    except Exception as e:  # e.g. a duplicate rid (found on submission), a timeout, the engine's death
        error = engine_api_error(e)
        if error is None:
            raise
        yield _sse(error.body())
    finally:
        # A disconnect cancels the request inside tm.generate (which aborts it); a stream that is
        # closed instead (GeneratorExit) must close it too, for the same abort.
        await agen.aclose()
    yield "data: [DONE]\n\n"


@router.post("/generate")
async def generate(body: GenerateBody, request: Request, state: State) -> Response:
    tm = state.require_ready()
    reqs, batched = _requests(body)
    tm.check_capacity(len(reqs))  # before the work of preparing them: a batch too large is refused at once
    # Validated and tokenized once, now: a bad request is a 400 before any prompt reaches the
    # scheduler (and before a stream's headers are sent). Media, constraints and long texts are
    # prepared off the event loop (and so is a large body).
    slow = any(r.slow_to_prepare() for r in reqs)
    prepared = await prepare(request, _prepare_all, tm.preparer, reqs, off_loop=slow)
    tm.check_capacity(len(prepared))  # again, before a stream's 200 goes out; generate() checks again
    tm.check_rids([p.rid for p in prepared])  # so: a running rid is a 400, not an error event in a 200 stream
    if body.stream:
        return StreamingResponse(_stream(tm, prepared[0]), media_type="text/event-stream")
    results = await until_disconnected(request, _all(tm, prepared))
    if results is None:
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    return JSONResponse(results if batched else results[0])


@router.get("/health")
async def health(state: State) -> dict[str, Any]:
    state.require_ready()
    return {"status": "ok"}


@router.get("/health_generate")
async def health_generate(state: State) -> dict[str, Any]:
    """Healthy when a one-token generation (an embedding model: an embedding) goes through the
    whole engine in time."""
    tm = state.require_ready()
    rid = f"health-{uuid.uuid4().hex}"
    embed = tm.preparer.pooling is not None
    params = None if embed else {"max_new_tokens": 1, "temperature": 0}
    req = tm.preparer.prepare(GenerateRequest(text="ping", sampling_params=params, rid=rid, embed=embed))
    what = "an embedding" if embed else "a one-token generation"
    try:
        result = await asyncio.wait_for(_one(tm, req), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(503, f"{what} took over {HEALTH_GENERATE_TIMEOUT_S:.0f} s") from None
    return {"status": "ok", "output_ids": result.get("output_ids", [])}


def _internals_shown(state: ServerState) -> bool:
    """Filesystem paths, the IPC directory and the whole config are shown to a caller who sent the
    API key (every caller, when one is set) or when `server.expose_internals` allows it."""
    return bool(state.config.server.api_key) or state.config.server.expose_internals


# What anyone may read of the engine and its config: what a client needs to use the model and what
# monitoring needs, but no path, address or secret.
_PUBLIC_ENGINE_INFO = (
    "architecture", "max_context_len", "max_total_tokens", "vocab_size", "dtype", "kv_dtype", "device",
    "attention_backend", "tp_size", "dp_size",
)
_PUBLIC_CONFIG_SECTIONS = ("scheduler", "cache", "grammar")  # not multimodal: its allowed roots and hosts


@router.get("/get_model_info")
async def get_model_info(state: State) -> dict[str, Any]:
    state.require_ready()
    info = state.engine.info
    out = {
        "served_model_name": state.served_model_name,
        "architecture": info.get("architecture"),
        "context_length": info["max_context_len"],
        "vocab_size": info["vocab_size"],
        "dtype": info.get("dtype"),
        "device": info.get("device"),
        "is_generation": info.get("pooling") is None,  # SGLang's name: False for an embedding model
        "pooling": info.get("pooling"),  # an embedding model's method, normalisation, sizes
    }
    if _internals_shown(state):
        out |= {"model_path": state.engine.model_path, "tokenizer_path": state.engine.tokenizer_path}
    return out


def _stats_json(stats: Any) -> dict[str, Any]:
    total = stats.total_slots
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "total_slots": total,
        "free_slots": stats.free_slots,
        "tree_slots": stats.tree_slots,
        "evictable_slots": stats.evictable_slots,
        "token_usage": (total - stats.free_slots - stats.evictable_slots) / total if total else 0.0,
        "cache_hit_rate": stats.cache_hit_rate,
        **stats.extra,
    }


@router.get("/get_server_info")
async def get_server_info(state: State) -> dict[str, Any]:
    """The stats are the scheduler's latest snapshot (`stats_age_s` old), answered at once: asking
    the scheduler would wait for its current step, seconds under a long prefill."""
    tm = state.require_ready()
    config = state.config.model_dump(mode="json")
    engine = state.engine.info
    if _internals_shown(state):
        if config["server"].get("api_key"):
            config["server"]["api_key"] = "<set>"  # never echo the secret
        engine = {**engine, "ipc_dir": state.engine.ipc_dir}
    else:
        config = {name: config[name] for name in _PUBLIC_CONFIG_SECTIONS}
        engine = {key: engine[key] for key in _PUBLIC_ENGINE_INFO if key in engine}
    from rxf import __version__

    stats, age = await tm.latest_stats()
    return {
        "version": __version__,
        "served_model_name": state.served_model_name,
        "config": config,
        "engine": engine,
        "stats": _stats_json(stats) | {"in_flight": len(tm.states)},
        "stats_age_s": round(age, 3),
    }


@router.post("/flush_cache")
async def flush_cache(state: State) -> dict[str, Any]:
    result = await state.require_ready().flush_cache()
    if not result.ok:
        raise APIError(400, result.message)
    return {"message": result.message}


@router.post("/start_profile")
async def start_profile(state: State, body: StartProfileBody | None = None) -> dict[str, Any]:
    """Profile the scheduler's steps into `runtime.profile_dir` (refused, 400, when it is unset or a
    profile runs); the answer names the profile's folder."""
    body = body or StartProfileBody()
    result = await state.require_ready().start_profile(body.num_steps, body.kernels)
    if not result.ok:
        raise APIError(400, result.message)
    return {"message": "profiling", "path": result.message}


@router.post("/stop_profile")
async def stop_profile(state: State) -> dict[str, Any]:
    """Stop the running profile and write it (400 when none runs); the answer names its folder."""
    result = await state.require_ready().stop_profile()
    if not result.ok:
        raise APIError(400, result.message)
    return {"message": "profile written", "path": result.message}


@router.post("/abort_request")
async def abort_request(body: AbortBody, state: State) -> dict[str, Any]:
    """Abort a running request by id; its consumer gets what it has with finish_reason "abort"."""
    tm = state.require_ready()
    return {"rid": body.rid, "found": await tm.abort(body.rid)}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    if state.ready and state.tokenizer_manager is not None:
        state.metrics.refresh((await state.tokenizer_manager.latest_stats())[0])
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
