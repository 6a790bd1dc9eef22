"""Admin requests of the TokenizerManager (stats, cache flush) against a scripted scheduler on real
ipc sockets: every request carries an id its reply repeats, so replies are matched by id, whatever
their order, and the reply to a caller that gave up is dropped without confusing the next caller."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc import codec
from rxf.core.ipc.messages import (
    AdminReply,
    AdminResult,
    FlushCacheReq,
    GetStatsReq,
    SchedulerStats,
    StatsReply,
    ToScheduler,
)
from rxf.testing import make_tiny_tokenizer


def _stats(num_running: int) -> SchedulerStats:
    return SchedulerStats(num_running, 0, 100, 100, 0, 0, 0.0)


class FakeScheduler:
    """The scheduler's end of the sockets: receives what the TokenizerManager sends, replies on cue."""

    def __init__(self, ctx: zmq.asyncio.Context, addrs: dict[str, str]) -> None:
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(addrs["scheduler"])
        self.send = ctx.socket(zmq.PUSH)
        self.send.connect(addrs["tokenizer"])
        self.decoder = codec.Decoder(ToScheduler)

    async def receive(self) -> object:
        return self.decoder.decode(await asyncio.wait_for(self.recv.recv(), 10))

    async def reply(self, msg: object) -> None:
        await self.send.send(codec.encode(msg))


def _run(tmp_path: Path, script) -> None:
    addrs = {"scheduler": f"ipc://{tmp_path}/scheduler", "tokenizer": f"ipc://{tmp_path}/tokenizer"}

    async def main() -> None:
        tm = TokenizerManager(make_tiny_tokenizer(64), addrs, {"max_context_len": 32, "vocab_size": 64})
        ctx = zmq.asyncio.Context()
        try:
            await tm.start()
            await script(tm, FakeScheduler(ctx, addrs))
        finally:
            ctx.destroy(linger=0)
            await tm.close()

    asyncio.run(main())


def test_replies_are_matched_by_id_in_any_order(tmp_path: Path) -> None:
    async def script(tm: TokenizerManager, sched: FakeScheduler) -> None:
        stats = asyncio.ensure_future(tm.get_stats())
        flush = asyncio.ensure_future(tm.flush_cache())
        asked = [await sched.receive(), await sched.receive()]
        (stats_req,) = [m for m in asked if isinstance(m, GetStatsReq)]
        (flush_req,) = [m for m in asked if isinstance(m, FlushCacheReq)]
        assert stats_req.req_id != flush_req.req_id
        # Answered last-asked first, with a stray reply to an id nobody asked for in between.
        await sched.reply(AdminReply(flush_req.req_id, AdminResult(False, "busy")))
        await sched.reply(StatsReply(10_000, _stats(99)))
        await sched.reply(StatsReply(stats_req.req_id, _stats(3)))
        assert (await asyncio.wait_for(stats, 10)).num_running == 3
        assert await asyncio.wait_for(flush, 10) == AdminResult(False, "busy")
        assert tm._admin_waiters == {}

    _run(tmp_path, script)


def test_the_late_reply_of_a_cancelled_call_goes_to_nobody(tmp_path: Path) -> None:
    async def script(tm: TokenizerManager, sched: FakeScheduler) -> None:
        gave_up = asyncio.ensure_future(tm.get_stats())
        first = await sched.receive()
        gave_up.cancel()  # e.g. a /get_server_info client that disconnected
        await asyncio.sleep(0)
        later = asyncio.ensure_future(tm.get_stats())
        second = await sched.receive()
        await sched.reply(StatsReply(first.req_id, _stats(1)))  # the late reply to the cancelled call
        await sched.reply(StatsReply(second.req_id, _stats(2)))
        assert (await asyncio.wait_for(later, 10)).num_running == 2
        # The receive loop survived the stray reply: a third call is answered too.
        third_call = asyncio.ensure_future(tm.get_stats())
        third = await sched.receive()
        await sched.reply(StatsReply(third.req_id, _stats(5)))
        assert (await asyncio.wait_for(third_call, 10)).num_running == 5
        assert not tm._recv_task.done()

    _run(tmp_path, script)
