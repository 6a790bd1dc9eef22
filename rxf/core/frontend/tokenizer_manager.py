"""The TokenizerManager: submits prepared requests to the scheduler and turns the detokenizer's
outputs back into per-request results (asyncio, in the caller's process). Requests are validated and
tokenized before they get here, once, by its `preparer` (`rxf.core.frontend.request_preparer`); it trusts
what it is given.

Slow consumers: a request's outputs wait in its `_ReqState` until its consumer takes them; past
`_MAX_PENDING_OUTPUTS` they are merged into the last one, so a client that reads nothing of its
stream costs its tokens and text (bounded by max_new_tokens), not an object per scheduler step.

Overload: `states` holds every request sent to the scheduler and not yet finished or abandoned,
and the scheduler only holds requests it was sent and that were not aborted, so refusing new ones
once `len(states)` reaches `RequestLimits.max_in_flight` bounds the scheduler's running + waiting
requests by that number (plus aborts still in transit, which it drops within a step) without
asking it: a full queue costs one comparison, not a round trip.

Request ids: a client names its request (`rid`, unique among the running ones), but the engine knows
each submission by an id of its own (`rid#N`, N counting submissions), so the outputs of a request
its client abandoned, still in transit or in the scheduler until the abort lands, can never reach a
later request that reuses the name.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from rxf.core.echo import echo
from rxf.core.frontend.dp_router import DpRouter, combine_results, combine_stats
from rxf.core.frontend.outputs import GenerateOutput, Logprobs
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import (
    EngineDeadError,
    OverloadedError,
    RequestError,
    RequestLimits,
    RequestTimeoutError,
)
from rxf.core.ipc import codec
from rxf.core.ipc.addresses import replica_addrs
from rxf.core.ipc.messages import (
    AbortReq,
    AdminReply,
    AdminResult,
    BatchStrOut,
    FlushCacheReq,
    GetStatsReq,
    PreparedRequest,
    ProfileReq,
    SchedulerStats,
    StatsReply,
    StatsSnapshot,
    StrOut,
    TokenOut,
    ToTokenizer,
)

if TYPE_CHECKING:
    from rxf.core.grammar import GrammarBackend

logger = logging.getLogger(__name__)

# The errors a request ends with are importable from here too: the server maps each to a status.
__all__ = ["EngineDeadError", "OverloadedError", "RequestError", "RequestTimeoutError", "TokenizerManager"]


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

    engine_rid: str  # the submission's id in the engine (the module docstring)
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
    into.timings = later.timings
    into.prompt_tokens, into.completion_tokens, into.cached_tokens, into.spec_verify_ct = (
        later.prompt_tokens, later.completion_tokens, later.cached_tokens, later.spec_verify_ct
    )


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
        self.limits = limits or RequestLimits()
        self.info = engine_info
        self.max_context_len: int = engine_info["max_context_len"]
        self.vocab_size: int = engine_info["vocab_size"]
        # Every front door's one validation. With `grammar`, each constraint is compiled (cached)
        # there, so an invalid one is a 400 before it is queued (`make_grammar_backend`).
        self.preparer = RequestPreparer.for_engine(
            tokenizer, engine_info, limits=self.limits, mm_processor=mm_processor, grammar=grammar
        )
        self.ctx = zmq.asyncio.Context()
        # One PUSH socket per data-parallel replica (replica 0's is `to_scheduler`).
        self.to_schedulers = []
        for addr in replica_addrs(addrs):
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self.to_schedulers.append(sock)
        self.to_scheduler = self.to_schedulers[0]
        self.router = DpRouter(len(self.to_schedulers))
        self.from_engine = self.ctx.socket(zmq.PULL)
        self.from_engine.bind(addrs["tokenizer"])
        self._decoder = codec.Decoder(ToTokenizer)
        # Running requests by the client's rid, and the same states by their engine rid.
        self.states: dict[str, _ReqState] = {}
        self._by_engine_rid: dict[str, _ReqState] = {}
        self._submissions = itertools.count()
        # Admin requests waiting for their reply, by the req_id the reply repeats.
        self._admin_waiters: dict[int, asyncio.Future[Any]] = {}
        self._admin_ids = itertools.count()
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
        if self.preparer.grammar is not None:
            self.preparer.grammar.close()  # its compile workers

    # ---- requests ----
    def check_capacity(self, n: int = 1, param: str | None = None) -> None:
        """Raise unless `n` more requests may start now: OverloadedError while the server is full,
        RequestError (naming `param`, the field that asked for them, if given) if n alone exceeds
        what it ever holds."""
        limit = self.limits.max_in_flight
        if limit is None:
            return
        if n > limit:
            field = f"{param}: " if param else ""
            raise RequestError(f"{field}the request needs {n} generations; the server runs at most {limit} at once")
        if len(self.states) + n > limit:
            raise OverloadedError(f"the server is at capacity ({limit} requests in flight); retry later")

    def check_rids(self, rids: list[str]) -> None:
        """Raise RequestError unless every rid is free: none running, none twice in `rids` (a stream's
        route checks before its 200 goes out; `generate` checks again)."""
        seen: set[str] = set()
        for rid in rids:
            if rid in self.states or rid in seen:
                raise RequestError(f"rid: a request with id {echo(rid)} is already running")
            seen.add(rid)

    async def generate(self, req: PreparedRequest) -> AsyncIterator[GenerateOutput]:
        """Yields incremental chunks (`options.stream`) or one final result.

        A chunk's `text` and `output_ids` are what this chunk adds; the final result's are complete.
        Cancelling the consumer (e.g. a disconnected client) aborts the request in the scheduler.
        """
        if self._dead:
            raise EngineDeadError(self._dead)
        rid, stream = req.rid, req.options.stream
        self.check_rids([rid])
        self.check_capacity()
        engine_rid = f"{rid}#{next(self._submissions)}"
        # No await since the checks: the bound holds, the rid is still free.
        state = self.states[rid] = self._by_engine_rid[engine_rid] = _ReqState(engine_rid)
        observer = self.observer
        if observer is not None:
            observer.on_start(rid, stream, time.perf_counter())
        text: list[str] = []
        ids: list[int] = []
        logprobs = Logprobs() if req.options.return_logprob else None
        finished = False
        timeout = self.limits.timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        # Whatever fails once `states` holds the request (routing included) must reach the `finally`
        # that drops it: a leaked entry would count against max_in_flight for the server's lifetime.
        to_scheduler = None
        try:
            to_scheduler = self.to_schedulers[self.router.route(engine_rid, req.input_ids, req.options.cache_salt)]
            await _send(to_scheduler, msgspec.structs.replace(req, rid=engine_rid))
            while not finished:
                item = await _next_output(state, deadline, timeout)
                if isinstance(item, BaseException):
                    raise item
                if observer is not None:
                    observer.on_output(rid, item, time.perf_counter())
                finished = item.token.finished is not None
                new_logprobs = Logprobs.of(item) if logprobs is not None else None
                if stream:
                    yield _output(rid, item, item.text_delta, item.token.new_token_ids, new_logprobs)
                    continue
                text.append(item.text_delta)
                ids += item.token.new_token_ids
                if logprobs is not None and new_logprobs is not None:
                    logprobs.extend(new_logprobs)
            if not stream:
                yield _output(rid, item, "".join(text), ids, logprobs)
        finally:
            self.states.pop(rid, None)
            self._by_engine_rid.pop(engine_rid, None)
            self.router.finished(engine_rid)
            if observer is not None:
                observer.on_end(rid)
            if not finished and not self._dead and to_scheduler is not None:
                await _send(to_scheduler, AbortReq(engine_rid))

    async def abort(self, rid: str) -> bool:
        """Abort the running request the client named `rid`; its consumer gets what it has with finish
        reason "abort". False when none runs under that name."""
        state = self.states.get(rid)
        if state is None:
            return False
        replica = self.router.replica_of(state.engine_rid)
        for d, sock in enumerate(self.to_schedulers):
            if replica is None or d == replica:
                await _send(sock, AbortReq(state.engine_rid))
        return True

    # ---- admin ----
    async def flush_cache(self) -> AdminResult:
        replies: list[AdminReply] = await self._admin(FlushCacheReq)
        result = combine_results([r.result for r in replies])
        if result.ok:
            self.router.forget_cache()
        return result

    async def start_profile(self, num_steps: int | None = None, kernels: bool = False) -> AdminResult:
        """Profile every rank's steps (`rxf/core/runner/step_profiler.py`) until `stop_profile`, or for
        `num_steps` steps; the result's message is the profile's folder, or why it was refused."""
        name = time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + uuid.uuid4().hex[:6]
        replies: list[AdminReply] = await self._admin(lambda i: ProfileReq(i, True, name, num_steps, kernels))
        return combine_results([r.result for r in replies])

    async def stop_profile(self) -> AdminResult:
        replies: list[AdminReply] = await self._admin(lambda i: ProfileReq(i, False))
        return combine_results([r.result for r in replies])

    async def get_stats(self) -> SchedulerStats:
        """Exact figures: asked of every replica, answered between two of its steps (a step of a
        long prefill may take seconds). Monitoring wants `latest_stats`."""
        replies: list[StatsReply] = await self._admin(GetStatsReq)
        return combine_stats([r.stats for r in replies])

    async def latest_stats(self) -> tuple[SchedulerStats, float]:
        """The replicas' latest snapshots (sent after their steps, and at once when they go idle),
        combined, and the age in seconds of the oldest; asked for when one is missing."""
        if self._dead:
            raise EngineDeadError(self._dead)
        if len(self._snapshots) < len(self.to_schedulers):
            return await self.get_stats(), 0.0
        snaps = [self._snapshots[d] for d in range(len(self.to_schedulers))]
        return combine_stats([s for s, _ in snaps]), time.monotonic() - min(t for _, t in snaps)

    async def _admin(self, make: Callable[[int], Any]) -> list[Any]:
        """Each replica's reply to `make(req_id)`, in replica order: every replica is asked with an
        id of its own, and a reply is matched to its request by that id, so admin requests may
        overlap and a caller that gives up (cancelled) leaves nothing a later reply could be
        mistaken for."""
        if self._dead:
            raise EngineDeadError(self._dead)
        loop = asyncio.get_running_loop()
        ids = [next(self._admin_ids) for _ in self.to_schedulers]
        futures = []
        for req_id in ids:
            futures.append(loop.create_future())
            self._admin_waiters[req_id] = futures[-1]
        try:
            for req_id, sock in zip(ids, self.to_schedulers, strict=True):
                await _send(sock, make(req_id))
            return list(await asyncio.gather(*futures))
        finally:
            for req_id in ids:
                self._admin_waiters.pop(req_id, None)

    # ---- engine -> us ----
    async def _recv_loop(self) -> None:
        while True:
            data = await self.from_engine.recv()
            try:
                msg = self._decoder.decode(data)
            except msgspec.MsgspecError as exc:  # a bug in a child, not a client's doing: say so
                logger.error("undecodable message from the engine (%s): %s", exc, data[:64])
                continue
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    state = self._by_engine_rid.get(out.token.rid)
                    if state is not None:  # else: already gone (abandoned by its consumer)
                        state.put(out)
            elif isinstance(msg, StatsSnapshot):
                self._snapshots[msg.dp_rank] = (msg.stats, time.monotonic())
            else:  # StatsReply, AdminReply
                fut = self._admin_waiters.get(msg.req_id)
                if fut is not None and not fut.done():  # else: its caller gave up
                    fut.set_result(msg)

    def fail_all(self, reason: str) -> None:
        """Called (on the event loop) when a child process died: nothing will answer any more."""
        self._dead = reason
        for state in self.states.values():
            state.put(EngineDeadError(reason))
        for fut in self._admin_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))


async def _send(sock: zmq.asyncio.Socket, msg: Any) -> None:
    # copy=False: a large message (a request's pixels) is handed to ZMQ without a copy; pyzmq
    # still copies those under its copy_threshold, where that is cheaper.
    await sock.send(codec.encode(msg), copy=False)


async def _next_output(state: _ReqState, deadline: float | None, timeout: float | None) -> StrOut | BaseException:
    if deadline is None:
        return await state.get()
    try:
        async with asyncio.timeout_at(deadline):
            return await state.get()
    except TimeoutError:  # the caller's `finally` aborts the request, releasing its KV
        raise RequestTimeoutError(f"the request ran longer than server.request_timeout_s = {timeout} s") from None


def _output(rid: str, last: StrOut, text: str, ids: list[int], logprobs: Logprobs | None) -> GenerateOutput:
    """An output holding `text` and `ids`, with the counts and finish of `last` (the newest)."""
    t = last.token
    return GenerateOutput(
        rid, text, ids, t.prompt_tokens, t.completion_tokens, t.cached_tokens, t.finished, logprobs, t.embedding,
        t.spec_verify_ct,
    )
