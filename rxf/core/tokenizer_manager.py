"""The TokenizerManager: validates and tokenizes requests, sends them to the scheduler, and turns
the detokenizer's outputs back into per-request results (asyncio, in the caller's process)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from rxf.core.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheResult,
    GetStatsReq,
    SchedulerStats,
    StrOut,
    TokenizedGenerateReq,
)
from rxf.core.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """The request is invalid; the message names the field and the reason (HTTP 400)."""


class EngineDeadError(RuntimeError):
    """A child process died; in-flight and new requests fail with this (HTTP 503)."""


@dataclass
class GenerateRequest:
    """One native generation request (a batch is a list of these)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | SamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: str | None = None


class RequestObserver(Protocol):
    """Optional hooks on each request's life (the server's latency metrics). Called on the event
    loop with `time.perf_counter()` times; implementations must be cheap and must not raise."""

    def on_start(self, rid: str, stream: bool, now: float) -> None: ...

    def on_output(self, rid: str, out: StrOut, now: float) -> None: ...

    def on_end(self, rid: str) -> None:
        """Always called last, whether the request finished, failed or was abandoned."""


@dataclass
class _ReqState:
    queue: asyncio.Queue[StrOut | BaseException] = field(default_factory=asyncio.Queue)


def _meta(out: StrOut, rid: str) -> dict[str, Any]:
    t = out.token
    return {
        "id": rid,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "cached_tokens": t.cached_tokens,
        "finish_reason": t.finished.to_json() if t.finished else None,
    }


class TokenizerManager:
    def __init__(self, tokenizer: Any, addrs: dict[str, str], engine_info: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.info = engine_info
        self.max_context_len: int = engine_info["max_context_len"]
        self.vocab_size: int = engine_info["vocab_size"]
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(addrs["scheduler"])
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.bind(addrs["tokenizer"])
        self.states: dict[str, _ReqState] = {}
        self._admin_waiters: list[asyncio.Future[Any]] = []
        self._dead: str | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.observer: RequestObserver | None = None

    async def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.ctx.destroy(linger=0)

    # ---- requests ----
    def tokenize_request(self, req: GenerateRequest) -> TokenizedGenerateReq:
        if (req.text is None) == (req.input_ids is None):
            raise RequestError("give exactly one of text and input_ids")
        if req.input_ids is not None:
            ids = list(req.input_ids)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"input_ids: every id must be an integer in [0, {self.vocab_size})")
        else:
            if not isinstance(req.text, str):
                raise RequestError("text: expected a string")
            ids = self.tokenizer.encode(req.text)
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_context_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the model's context length is {self.max_context_len}"
            )
        try:
            params = (
                req.sampling_params
                if isinstance(req.sampling_params, SamplingParams)
                else SamplingParams.from_dict(req.sampling_params)
            )
            params.verify(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if req.top_logprobs_num < 0:
            raise RequestError("top_logprobs_num: must be >= 0")
        if req.logprob_start_len >= len(ids):
            raise RequestError(f"logprob_start_len: must be < the prompt length {len(ids)}")
        return TokenizedGenerateReq(
            rid=req.rid or uuid.uuid4().hex,
            input_ids=ids,
            sampling_params=params,
            stream=req.stream,
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num,
        )

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Yields incremental chunks (`stream=True`) or one final result.

        A chunk's `text` and `output_ids` are what this chunk adds; the final result's are complete.
        Cancelling the consumer (e.g. a disconnected client) aborts the request in the scheduler.
        """
        if self._dead:
            raise EngineDeadError(self._dead)
        msg = self.tokenize_request(req)
        if msg.rid in self.states:
            raise RequestError(f"rid: a request with id {msg.rid!r} is already running")
        state = self.states[msg.rid] = _ReqState()
        observer = self.observer
        if observer is not None:
            observer.on_start(msg.rid, msg.stream, time.perf_counter())
        text: list[str] = []
        ids: list[int] = []
        logprobs = _LogprobAccumulator(msg.return_logprob)
        finished = False
        try:
            await self.to_scheduler.send_pyobj(msg)
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if observer is not None:
                    observer.on_output(msg.rid, item, time.perf_counter())
                finished = item.token.finished is not None
                text.append(item.text_delta)
                ids += item.token.new_token_ids
                logprobs.add(item)
                if msg.stream:
                    chunk = {"text": item.text_delta, "output_ids": item.token.new_token_ids}
                    chunk["meta_info"] = _meta(item, msg.rid) | logprobs.delta(item)
                    yield chunk
            if not msg.stream:
                yield {"text": "".join(text), "output_ids": ids, "meta_info": _meta(item, msg.rid) | logprobs.total()}
        finally:
            self.states.pop(msg.rid, None)
            if observer is not None:
                observer.on_end(msg.rid)
            if not finished and not self._dead:
                await self.to_scheduler.send_pyobj(AbortReq(msg.rid))

    async def abort(self, rid: str) -> None:
        await self.to_scheduler.send_pyobj(AbortReq(rid))

    # ---- admin ----
    async def flush_cache(self) -> FlushCacheResult:
        return await self._admin(FlushCacheReq())

    async def get_stats(self) -> SchedulerStats:
        return await self._admin(GetStatsReq())

    async def _admin(self, msg: Any) -> Any:
        if self._dead:
            raise EngineDeadError(self._dead)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._admin_waiters.append(fut)
        await self.to_scheduler.send_pyobj(msg)
        return await fut

    # ---- engine -> us ----
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.from_engine.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    state = self.states.get(out.token.rid)
                    if state is not None:  # else: already gone (aborted by its consumer)
                        state.queue.put_nowait(out)
            elif self._admin_waiters:  # admin replies come back in request order
                self._admin_waiters.pop(0).set_result(msg)
            else:
                logger.error("unexpected message from the engine: %r", type(msg).__name__)

    def fail_all(self, reason: str) -> None:
        """Called (on the event loop) when a child process died: nothing will answer any more."""
        self._dead = reason
        for state in self.states.values():
            state.queue.put_nowait(EngineDeadError(reason))
        for fut in self._admin_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._admin_waiters.clear()


class _LogprobAccumulator:
    """Collects logprobs in the result shape: lists of (logprob, token_id) pairs."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.out: dict[str, list[Any]] = {"output_token_logprobs": [], "output_top_logprobs": []}

    def delta(self, item: StrOut) -> dict[str, Any]:
        if not self.enabled:
            return {}
        t = item.token
        d: dict[str, Any] = {
            "output_token_logprobs": list(zip(t.output_token_logprobs or [], t.new_token_ids, strict=False)),
            "output_top_logprobs": [[(lp, tid) for tid, lp in top] for top in t.output_top_logprobs or []],
        }
        if t.input_token_logprobs is not None:
            d["input_token_logprobs"] = list(zip(t.input_token_logprobs, t.input_token_ids or [], strict=False))
            d["input_top_logprobs"] = [[(lp, tid) for tid, lp in top] for top in t.input_top_logprobs or []]
        return d

    def add(self, item: StrOut) -> None:
        if self.enabled:
            for key, value in self.delta(item).items():
                self.out.setdefault(key, []).extend(value)

    def total(self) -> dict[str, Any]:
        return self.out if self.enabled else {}
