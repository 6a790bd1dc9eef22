"""What a front door does on the server's event loop: a request whose preparation may take long (an
output constraint to compile — the first also builds the grammar backend's tables —, media to decode
or a long text to tokenize) is prepared in a worker thread (`RequestPreparer.prepare_async`), so
other clients' requests keep flowing; the TokenizerManager then submits it as it is, and outputs a
consumer does not take are merged, not queued one per step."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from rxf.core.frontend.requests import LONG_TEXT_CHARS, GenerateRequest
from rxf.core.frontend.tokenizer_manager import TokenizerManager, _ReqState
from rxf.core.ipc.messages import FinishReason, StrOut, TokenOut
from rxf.core.sampling_params import SamplingParams
from rxf.testing import make_tiny_tokenizer


class _RecordingGrammar:
    """Stands in for the grammar backend: records the thread of each check of a constraint."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def validate(self, kind: str, text: str) -> None:
        self.threads.append(threading.current_thread().name)

    def close(self) -> None:
        pass


class _Stop(Exception):
    """Raised by the router: the test ends each request once it is prepared."""


def _stop(*_: Any) -> int:
    raise _Stop


@pytest.mark.parametrize(
    ("params", "compiles"),
    [
        ({"max_new_tokens": 2}, False),
        ({"max_new_tokens": 2, "regex": "a+"}, True),
        (SamplingParams.from_dict({"max_new_tokens": 2, "json_schema": '{"type": "object"}'}), True),
    ],
)
def test_constrained_requests_are_prepared_off_the_event_loop(tmp_path: Path, params, compiles) -> None:
    addrs = {"scheduler": f"ipc://{tmp_path}/scheduler", "tokenizer": f"ipc://{tmp_path}/tokenizer"}
    grammar = _RecordingGrammar()
    tm = TokenizerManager(make_tiny_tokenizer(64), addrs, {"max_context_len": 32, "vocab_size": 64}, grammar=grammar)
    tm.router.route = _stop  # type: ignore[method-assign]
    loop_thread: list[str] = []

    async def run() -> None:
        loop_thread.append(threading.current_thread().name)
        prepared = await tm.preparer.prepare_async(GenerateRequest(input_ids=[1, 2, 3], sampling_params=params))
        with pytest.raises(_Stop):
            async for _ in tm.generate(prepared):
                pass

    try:
        asyncio.run(run())
    finally:
        asyncio.run(tm.close())
    if compiles:
        assert len(grammar.threads) == 1 and grammar.threads[0] != loop_thread[0]
    else:
        assert grammar.threads == []
    assert tm.states == {}


def test_a_long_text_is_tokenized_off_the_event_loop(tmp_path: Path) -> None:
    addrs = {"scheduler": f"ipc://{tmp_path}/scheduler", "tokenizer": f"ipc://{tmp_path}/tokenizer"}
    tokenizer = make_tiny_tokenizer(64)
    threads: dict[int, str] = {}
    encode = tokenizer.encode

    def recording_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        threads[len(text)] = threading.current_thread().name
        return encode(text, *args, **kwargs)[:4]

    tokenizer.encode = recording_encode
    tm = TokenizerManager(tokenizer, addrs, {"max_context_len": LONG_TEXT_CHARS, "vocab_size": 64})
    tm.router.route = _stop  # type: ignore[method-assign]

    async def run() -> str:
        for text in ("a" * 10, "a " * (LONG_TEXT_CHARS // 2 + 1)):
            prepared = await tm.preparer.prepare_async(GenerateRequest(text=text, sampling_params={"max_new_tokens": 1}))
            with pytest.raises(_Stop):
                async for _ in tm.generate(prepared):
                    pass
        return threading.current_thread().name

    try:
        loop_thread = asyncio.run(run())
    finally:
        asyncio.run(tm.close())
    short, long = sorted(threads)
    assert threads[short] == loop_thread and threads[long] != loop_thread


def _out(ids: list[int], text: str, finished: bool = False) -> StrOut:
    token = TokenOut("r", ids, FinishReason("length") if finished else None, 3, len(ids), 0,
                     output_token_logprobs=[-1.0] * len(ids), output_top_logprobs=[[(i, -1.0)] for i in ids])
    return StrOut(token, text)


def test_outputs_a_consumer_does_not_take_are_merged_into_one() -> None:
    """A client that reads nothing of its stream: past a few outputs waiting, later ones grow the
    last one instead of queueing an object per step; taking them gives every token and character
    in order, then the finish."""

    async def run() -> list[StrOut]:
        state = _ReqState("r#0")
        for i in range(1000):
            state.put(_out([i], f"<{i}>", finished=i == 999))
        assert len(state.pending) == 8
        taken = []
        while state.pending:
            taken.append(await state.get())
        return taken

    taken = asyncio.run(run())
    ids = [t for out in taken for t in out.token.new_token_ids]
    assert ids == list(range(1000))
    assert "".join(out.text_delta for out in taken) == "".join(f"<{i}>" for i in range(1000))
    last = taken[-1].token
    assert len(last.output_token_logprobs) == len(last.new_token_ids) == len(last.output_top_logprobs) == 993
    assert last.finished is not None and last.completion_tokens == 1
