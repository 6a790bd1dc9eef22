"""The TokenizerManager: validates and tokenizes requests, sends them to the scheduler, and turns
the detokenizer's outputs back into per-request results (asyncio, in the caller's process).

Slow consumers: a request's outputs wait in its `_ReqState` until its consumer takes them; past
`_MAX_PENDING_OUTPUTS` they are merged into the last one, so a client that reads nothing of its
stream costs its tokens and text (bounded by max_new_tokens), not an object per scheduler step.

Overload: `states` holds every request sent to the scheduler and not yet finished or abandoned,
and the scheduler only holds requests it was sent and that were not aborted, so refusing new ones
once `len(states)` reaches `RequestLimits.max_in_flight` bounds the scheduler's running + waiting
requests by that number (plus aborts still in transit, which it drops within a step) without
asking it: a full queue costs one comparison, not a round trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import zmq
import zmq.asyncio

from rxf.core.dp_router import DpRouter, combine_flush, combine_stats, replica_addrs
from rxf.core.echo import echo
from rxf.core.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheResult,
    GetStatsReq,
    SchedulerStats,
    StatsSnapshot,
    StrOut,
    TokenizedGenerateReq,
    TokenOut,
)
from rxf.core.requests import (
    MAX_CACHE_SALT_LEN,
    MAX_RID_LEN,
    MAX_TOP_LOGPROBS,
    EngineDeadError,
    GenerateRequest,
    OverloadedError,
    RequestError,
    RequestLimits,
    RequestTimeoutError,
    check_prompt_chars,
)
from rxf.core.sampling_params import SamplingParams, fit_max_new_tokens

if TYPE_CHECKING:
    from rxf.core.grammar import GrammarBackend

logger = logging.getLogger(__name__)

def _as_list(value: Any) -> list[Any] | None:
    return None if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


class RequestObserver(Protocol):
    """Optional hooks on each request's life (the server's latency metrics). Called on the event
    loop with `time.perf_counter()` times; implementations must be cheap and must not raise."""

    def on_start(self, rid: str, stream: bool, now: float) -> None: ...

    def on_output(self, rid: str, out: StrOut, now: float) -> None: ...

    def on_end(self, rid: str) -> None:
        """Always called last, whether the request finished, failed or was abandoned."""


# Outputs of one request kept apart for its consumer; later ones are merged into the last.
_MAX_PENDING_OUTPUTS = 8


@dataclass
class _ReqState:
    """One request's outputs (and a failure, last) not yet taken by its consumer."""

    pending: deque[StrOut | BaseException] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Text of outputs merged into pending[-1], joined when it is taken (not copied on every merge).
    merged_text: list[str] = field(default_factory=list)

    def put(self, item: StrOut | BaseException) -> None:
        last = self.pending[-1] if self.pending else None
        if len(self.pending) >= _MAX_PENDING_OUTPUTS and isinstance(last, StrOut) and isinstance(item, StrOut):
            _merge_token_out(last.token, item.token)
            self.merged_text.append(item.text_delta)
        else:
            self._join_merged_text()
            self.pending.append(item)
        self.ready.set()

    async def get(self) -> StrOut | BaseException:
        while not self.pending:
            self.ready.clear()
            await self.ready.wait()
        if len(self.pending) == 1:
            self._join_merged_text()
        return self.pending.popleft()

    def _join_merged_text(self) -> None:
        if self.merged_text:
            last = self.pending[-1]
            assert isinstance(last, StrOut)
            last.text_delta = "".join([last.text_delta, *self.merged_text])
            self.merged_text.clear()


def _merge_token_out(into: TokenOut, later: TokenOut) -> None:
    """`into` becomes the output of both steps: their tokens (and logprobs) in order, `later`'s
    counts and finish. Prompt logprobs come with a request's first output only."""
    into.new_token_ids.extend(later.new_token_ids)
    for name in ("output_token_logprobs", "output_top_logprobs"):
        extra = getattr(later, name)
        if extra:
            mine = getattr(into, name)
            if mine is None:
                setattr(into, name, list(extra))
            else:
                mine.extend(extra)
    into.finished = later.finished
    into.prompt_tokens, into.completion_tokens, into.cached_tokens = (
        later.prompt_tokens, later.completion_tokens, later.cached_tokens
    )


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
    def __init__(
        self,
        tokenizer: Any,
        addrs: dict[str, str],
        engine_info: dict[str, Any],
        limits: RequestLimits | None = None,
        mm_processor: Any = None,
        grammar: GrammarBackend | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor  # None: the model takes no images
        # Compiles each request's constraint (cached) so an invalid one is a 400 before it is queued
        # (`make_grammar_backend`); None: not checked here (the scheduler then aborts the request).
        self.grammar = grammar
        self.limits = limits or RequestLimits()
        self.info = engine_info
        self.max_context_len: int = engine_info["max_context_len"]
        self.vocab_size: int = engine_info["vocab_size"]
        self.ctx = zmq.asyncio.Context()
        # One PUSH socket per data-parallel replica (replica 0's is `to_scheduler`).
        self.to_schedulers = []
        for addr in replica_addrs(addrs):
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self.to_schedulers.append(sock)
        self.to_scheduler = self.to_schedulers[0]
        self.router = DpRouter(len(self.to_schedulers))
        self._admin_lock = asyncio.Lock()
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.bind(addrs["tokenizer"])
        self.states: dict[str, _ReqState] = {}
        self._admin_waiters: list[asyncio.Future[Any]] = []
        # Each replica's latest StatsSnapshot and when it arrived (time.monotonic()).
        self._snapshots: dict[int, tuple[SchedulerStats, float]] = {}
        self._dead: str | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self.observer: RequestObserver | None = None

    async def start(self) -> None:
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self.ctx.destroy(linger=0)
        if self.grammar is not None:
            self.grammar.close()  # its compile workers

    # ---- requests ----
    def tokenize_request(self, req: GenerateRequest) -> TokenizedGenerateReq:
        if (req.text is None) == (req.input_ids is None):
            raise RequestError("give exactly one of text and input_ids")
        if req.input_ids is not None:
            ids = list(req.input_ids)
            self._check_prompt_len(len(ids))  # before the O(n) scan below (images only add tokens)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"input_ids: every id must be an integer in [0, {self.vocab_size})")
        else:
            if not isinstance(req.text, str):
                raise RequestError("text: expected a string")
            check_prompt_chars(req.text, self.tokenizer, self.max_context_len, "text")
            ids = self.tokenizer.encode(req.text)
        mm_items = req.mm_items
        images, videos = _as_list(req.image_data), _as_list(req.video_data)
        # A multimodal model checks every prompt: placeholders without images are an error too.
        if mm_items is None and (images or videos or self.mm_processor is not None):
            if self.mm_processor is None:
                raise RequestError(f"{'image_data' if images else 'video_data'}: this model takes no images or videos")
            try:
                ids, mm_items = self.mm_processor.process(ids, images, videos)
            except ValueError as e:
                raise RequestError(str(e)) from None
        if not ids:
            raise RequestError("the prompt is empty")
        self._check_prompt_len(len(ids))
        try:
            params = (
                req.sampling_params
                if isinstance(req.sampling_params, SamplingParams)
                else SamplingParams.from_dict(req.sampling_params)
            )
            params.verify(self.vocab_size)
            self.limits.check_params(params)
            self._fit_context(req, params, len(ids))
        except ValueError as e:
            raise RequestError(str(e)) from None
        self._check_grammar(params)
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num: must be in [0, {MAX_TOP_LOGPROBS}], got {echo(req.top_logprobs_num)}")
        salt = req.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_LEN):
            raise RequestError(f"cache_salt: must be a non-empty string of at most {MAX_CACHE_SALT_LEN} characters")
        self.limits.check_priority(req.priority)
        if req.rid is not None and not (isinstance(req.rid, str) and len(req.rid) <= MAX_RID_LEN):
            raise RequestError(f"rid: must be a string of at most {MAX_RID_LEN} characters")
        if not -1 <= req.logprob_start_len < len(ids):
            raise RequestError(
                f"logprob_start_len: must be -1 (output tokens only) or in [0, {len(ids)}) (the prompt's "
                f"tokens), got {echo(req.logprob_start_len)}"
            )
        return TokenizedGenerateReq(
            rid=req.rid or uuid.uuid4().hex,
            input_ids=ids,
            sampling_params=params,
            stream=req.stream,
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num,
            cache_salt=salt,
            priority=req.priority,
            mm_items=mm_items or None,
        )

    def _check_prompt_len(self, n: int) -> None:
        if n >= self.max_context_len:
            raise RequestError(f"the prompt has {n} tokens; the model's context length is {self.max_context_len}")

    def _fit_context(self, req: GenerateRequest, params: SamplingParams, prompt_len: int) -> None:
        """`fit_max_new_tokens` for the native request: a max_new_tokens it gave (or a whole
        SamplingParams) must fit the context; the default is cut to fit."""
        given = req.sampling_params
        explicit = isinstance(given, SamplingParams) or (given is not None and "max_new_tokens" in given)
        params.max_new_tokens = fit_max_new_tokens(
            params.max_new_tokens if explicit else None, params.max_new_tokens, prompt_len, self.max_context_len,
            "sampling_params.max_new_tokens",
        )
        params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)

    def _check_grammar(self, params: SamplingParams) -> None:
        from rxf.core.grammar import GrammarError

        constraint = params.grammar
        if constraint is None or self.grammar is None:
            return
        kind, text = constraint
        try:
            self.grammar.validate(kind, text)
        except GrammarError as e:
            raise RequestError(f"sampling_params.{kind}: {e}") from None

    def check_capacity(self, n: int = 1) -> None:
        """Raise unless `n` more requests may start now: OverloadedError while the server is full,
        RequestError if n alone exceeds what it ever holds."""
        limit = self.limits.max_in_flight
        if limit is None:
            return
        if n > limit:
            raise RequestError(f"the request needs {n} generations; the server runs at most {limit} at once")
        if len(self.states) + n > limit:
            raise OverloadedError(f"the server is at capacity ({limit} requests in flight); retry later")

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Yields incremental chunks (`stream=True`) or one final result.

        A chunk's `text` and `output_ids` are what this chunk adds; the final result's are complete.
        Cancelling the consumer (e.g. a disconnected client) aborts the request in the scheduler.
        """
        if self._dead:
            raise EngineDeadError(self._dead)
        if req.slow_to_prepare():  # media decoding, grammar compiling: off the event loop
            msg = await asyncio.to_thread(self.tokenize_request, req)
        else:
            msg = self.tokenize_request(req)
        if msg.rid in self.states:
            raise RequestError(f"rid: a request with id {echo(msg.rid)} is already running")
        self.check_capacity()
        state = self.states[msg.rid] = _ReqState()  # no await since the check: the bound holds
        observer = self.observer
        if observer is not None:
            observer.on_start(msg.rid, msg.stream, time.perf_counter())
        text: list[str] = []
        ids: list[int] = []
        logprobs = _LogprobAccumulator(msg.return_logprob)
        finished = False
        timeout = self.limits.timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        # Whatever fails once `states` holds the request (routing included) must reach the `finally`
        # that drops it: a leaked entry would count against max_in_flight for the server's lifetime.
        to_scheduler = None
        try:
            to_scheduler = self.to_schedulers[self.router.route(msg.rid, msg.input_ids, msg.cache_salt)]
            await to_scheduler.send_pyobj(msg)
            while not finished:
                item = await _next_output(state, deadline, timeout)
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
            self.router.finished(msg.rid)
            if observer is not None:
                observer.on_end(msg.rid)
            if not finished and not self._dead and to_scheduler is not None:
                await to_scheduler.send_pyobj(AbortReq(msg.rid))

    async def abort(self, rid: str) -> None:
        replica = self.router.replica_of(rid)
        for d, sock in enumerate(self.to_schedulers):
            if replica is None or d == replica:
                await sock.send_pyobj(AbortReq(rid))

    # ---- admin ----
    async def flush_cache(self) -> FlushCacheResult:
        result = combine_flush(await self._admin(FlushCacheReq()))
        if result.ok:
            self.router.forget_cache()
        return result

    async def get_stats(self) -> SchedulerStats:
        """Exact figures: asked of every replica, answered between two of its steps (a step of a
        long prefill may take seconds). Monitoring wants `latest_stats`."""
        return combine_stats(await self._admin(GetStatsReq()))

    async def latest_stats(self) -> tuple[SchedulerStats, float]:
        """The replicas' latest snapshots (sent after their steps, and at once when they go idle),
        combined, and the age in seconds of the oldest; asked for when one is missing."""
        if self._dead:
            raise EngineDeadError(self._dead)
        if len(self._snapshots) < len(self.to_schedulers):
            return await self.get_stats(), 0.0
        snaps = [self._snapshots[d] for d in range(len(self.to_schedulers))]
        return combine_stats([s for s, _ in snaps]), time.monotonic() - min(t for _, t in snaps)

    async def _admin(self, msg: Any) -> list[Any]:
        """Each replica's reply, in replica order. One admin message is in flight at a time, so the
        replies (which carry no replica id) cannot be mistaken for one another."""
        replies = []
        async with self._admin_lock:
            for sock in self.to_schedulers:
                if self._dead:
                    raise EngineDeadError(self._dead)
                fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                self._admin_waiters.append(fut)
                await sock.send_pyobj(msg)
                replies.append(await fut)
        return replies

    # ---- engine -> us ----
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.from_engine.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    state = self.states.get(out.token.rid)
                    if state is not None:  # else: already gone (aborted by its consumer)
                        state.put(out)
            elif isinstance(msg, StatsSnapshot):
                self._snapshots[msg.dp_rank] = (msg.stats, time.monotonic())
            elif self._admin_waiters:  # admin replies come back in request order
                self._admin_waiters.pop(0).set_result(msg)
            else:
                logger.error("unexpected message from the engine: %r", type(msg).__name__)

    def fail_all(self, reason: str) -> None:
        """Called (on the event loop) when a child process died: nothing will answer any more."""
        self._dead = reason
        for state in self.states.values():
            state.put(EngineDeadError(reason))
        for fut in self._admin_waiters:
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._admin_waiters.clear()


async def _next_output(state: _ReqState, deadline: float | None, timeout: float | None) -> StrOut | BaseException:
    if deadline is None:
        return await state.get()
    try:
        async with asyncio.timeout_at(deadline):
            return await state.get()
    except TimeoutError:  # the caller's `finally` aborts the request, releasing its KV
        raise RequestTimeoutError(f"the request ran longer than server.request_timeout_s = {timeout} s") from None


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
