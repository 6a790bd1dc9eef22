"""What the TokenizerManager does on the server's event loop: a request whose preparation may take
long (an output constraint to compile — the first also builds the grammar backend's tables — or
media to decode) is prepared in a worker thread, so other clients' requests keep flowing."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from rxf.core.requests import GenerateRequest
from rxf.core.sampling_params import SamplingParams
from rxf.core.tokenizer_manager import TokenizerManager
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

    def stop(*_: Any) -> int:
        raise _Stop

    tm.router.route = stop  # type: ignore[method-assign]
    loop_thread: list[str] = []

    async def run() -> None:
        loop_thread.append(threading.current_thread().name)
        with pytest.raises(_Stop):
            async for _ in tm.generate(GenerateRequest(input_ids=[1, 2, 3], sampling_params=params)):
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
