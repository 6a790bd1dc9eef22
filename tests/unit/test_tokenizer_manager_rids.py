"""A client's rid names its request among the running ones only; the engine knows each submission by
an id of its own. So a request whose client hung up, and whose last outputs (its abort's "abort"
finish among them) are still on their way from the scheduler, can never hand them to a later request
that reuses its rid (found by a hostile-input audit: a disconnect then an immediate reuse got the old
request's tokens and finish in 35 of 40 tries, and left the new one running unread)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from rxf.core.frontend import tokenizer_manager as tm_module
from rxf.core.frontend.requests import GenerateRequest, RequestError
from rxf.core.frontend.tokenizer_manager import TokenizerManager
from rxf.core.ipc import codec
from rxf.core.ipc.messages import (
    AbortReq,
    BatchStrOut,
    FinishReason,
    PreparedRequest,
    RequestOptions,
    StrOut,
    TokenOut,
)
from rxf.testing import make_tiny_tokenizer


def _out(engine_rid: str, ids: list[int], finish: str | None = None) -> bytes:
    token = TokenOut(engine_rid, ids, FinishReason(finish) if finish else None, 3, len(ids), 0)
    return codec.encode(BatchStrOut([StrOut(token, "".join(f"<{i}>" for i in ids))]))


def test_a_reused_rid_never_gets_the_abandoned_requests_outputs(tmp_path: Path, monkeypatch) -> None:
    addrs = {"scheduler": f"ipc://{tmp_path}/scheduler", "tokenizer": f"ipc://{tmp_path}/tokenizer"}
    tm = TokenizerManager(make_tiny_tokenizer(64), addrs, {"max_context_len": 32, "vocab_size": 64})
    sent: list[Any] = []

    async def record(sock: Any, msg: Any) -> None:  # what would go to the scheduler
        sent.append(msg)

    monkeypatch.setattr(tm_module, "_send", record)

    def prepared(stream: bool) -> PreparedRequest:
        return tm.preparer.prepare(GenerateRequest(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4},
                                                   options=RequestOptions(stream=stream), rid="Y1"))

    async def run() -> dict[str, Any]:
        await tm.start()
        engine = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        engine.connect(addrs["tokenizer"])
        try:
            first = tm.generate(prepared(stream=True))
            a_chunk = asyncio.create_task(anext(first))
            await asyncio.sleep(0.05)
            a_rid = sent[-1].rid
            await engine.send(_out(a_rid, [5]))
            assert (await a_chunk).output_ids == [5]
            await first.aclose()  # the client hung up: A is aborted, its rid free again
            assert sent[-1] == AbortReq(a_rid)
            assert "Y1" not in tm.states

            second = asyncio.create_task(anext(tm.generate(prepared(stream=False))))
            await asyncio.sleep(0.05)
            b_rid = sent[-1].rid
            assert b_rid != a_rid and sent[-1].input_ids == [1, 2, 3]
            # A's abort lands after B started: its tokens and finish must go nowhere
            await engine.send(_out(a_rid, [6, 7], finish="abort"))
            await asyncio.sleep(0.05)
            assert not second.done()
            # while B runs, its name is taken, as before; so is a name twice in one batch
            with pytest.raises(RequestError, match="already running"):
                tm.check_rids(["Y1"])
            with pytest.raises(RequestError, match="already running"):
                tm.check_rids(["Y2", "Y2"])
            await engine.send(_out(b_rid, [9, 10], finish="length"))
            b = await asyncio.wait_for(second, 5)
            return {"rid": b.rid, "ids": b.output_ids, "finish": b.finish_reason.type}
        finally:
            engine.close(linger=0)
            await tm.close()

    assert asyncio.run(run()) == {"rid": "Y1", "ids": [9, 10], "finish": "length"}


def test_abort_by_rid_reaches_the_running_submission(tmp_path: Path, monkeypatch) -> None:
    """`/abort_request` names the client's rid; the abort the scheduler gets names the submission."""
    addrs = {"scheduler": f"ipc://{tmp_path}/scheduler", "tokenizer": f"ipc://{tmp_path}/tokenizer"}
    tm = TokenizerManager(make_tiny_tokenizer(64), addrs, {"max_context_len": 32, "vocab_size": 64})
    sent: list[Any] = []

    async def record(sock: Any, msg: Any) -> None:
        sent.append(msg)

    monkeypatch.setattr(tm_module, "_send", record)

    async def run() -> tuple[bool, bool]:
        req = tm.preparer.prepare(GenerateRequest(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}, rid="r"))
        task = asyncio.create_task(anext(tm.generate(req)))
        await asyncio.sleep(0.05)
        try:
            found = await tm.abort("r")
            assert sent[-1] == AbortReq(sent[0].rid) and sent[0].rid != "r"
            return found, await tm.abort("not-running")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await tm.close()

    assert asyncio.run(run()) == (True, False)
