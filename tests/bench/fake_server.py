"""A fake streaming LLM server with known timings, for checking the bench harness's arithmetic.

Every request streams `max_tokens` tokens ("tok0 tok1 ..."): the first FIRST_S after the request
arrives, then one every GAP_S. Send times are absolute (arrival + FIRST_S + i*GAP_S), so scheduling
jitter never accumulates. Usage (and rxf's meta_info) reports prompt_tokens = the prompt's word
count and cached_tokens = half of it. A prompt starting with "FAIL" gets HTTP 500; one starting
with "BREAK" gets an error event after its first token. The server records each request's arrival
time and the peak number of requests in flight. `model_info`, when given, is what
`/get_model_info` answers.

Runs uvicorn in a daemon thread on a free loopback port: `with FakeServer() as srv: srv.url`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FIRST_S = 0.050
GAP_S = 0.020


class FakeServer:
    def __init__(self, include_usage: bool = True, model_info: dict[str, Any] | None = None) -> None:
        self.include_usage = include_usage
        self.arrivals: list[float] = []  # time.perf_counter() of each request's arrival
        self.in_flight = 0
        self.peak = 0
        self.app = FastAPI()
        self.app.post("/v1/completions")(self._completions)
        self.app.post("/v1/chat/completions")(self._chat)
        self.app.post("/generate")(self._generate)
        if model_info is not None:  # what /get_model_info answers (else a 404, as a server without it)
            self.app.get("/get_model_info")(lambda: model_info)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)

    async def _tokens(self, n: int, fail_after_first: bool) -> AsyncIterator[tuple[int, str | None]]:
        """(index, token text) at the known times; a None text means: send an error now."""
        arrival = time.perf_counter()
        self.in_flight += 1  # the event loop is single-threaded: no lock needed
        self.peak = max(self.peak, self.in_flight)
        try:
            for i in range(n):
                await asyncio.sleep(max(0.0, arrival + FIRST_S + i * GAP_S - time.perf_counter()))
                if fail_after_first and i == 1:
                    yield i, None
                    return
                yield i, f"tok{i} "
        finally:
            self.in_flight -= 1

    def _start(self, prompt: str) -> JSONResponse | None:
        self.arrivals.append(time.perf_counter())
        if prompt.startswith("FAIL"):
            return JSONResponse({"error": {"message": "asked to fail"}}, status_code=500)
        return None

    def _usage(self, prompt: str, n: int) -> dict[str, Any]:
        words = len(prompt.split())
        return {
            "prompt_tokens": words,
            "completion_tokens": n,
            "total_tokens": words + n,
            "prompt_tokens_details": {"cached_tokens": words // 2},
        }

    def _sse(self, events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            async for e in events:
                yield f"data: {json.dumps(e)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _openai(self, body: dict[str, Any], prompt: str, chat: bool) -> Any:
        if (failed := self._start(prompt)) is not None:
            return failed
        n = body["max_tokens"]

        async def events() -> AsyncIterator[dict[str, Any]]:
            async for i, text in self._tokens(n, prompt.startswith("BREAK")):
                if text is None:
                    yield {"error": {"message": "broke mid-stream"}}
                    return
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                choice["finish_reason"] = "length" if i == n - 1 else None
                yield {"choices": [choice]}
            if self.include_usage and (body.get("stream_options") or {}).get("include_usage"):
                yield {"choices": [], "usage": self._usage(prompt, n)}

        return self._sse(events())

    async def _completions(self, request: Request) -> Any:
        body = await request.json()
        return await self._openai(body, body["prompt"], chat=False)

    async def _chat(self, request: Request) -> Any:
        body = await request.json()
        return await self._openai(body, body["messages"][-1]["content"], chat=True)

    async def _generate(self, request: Request) -> Any:
        body = await request.json()
        prompt = body["text"]
        if (failed := self._start(prompt)) is not None:
            return failed
        n = body["sampling_params"]["max_new_tokens"]

        async def events() -> AsyncIterator[dict[str, Any]]:
            text = ""
            async for i, piece in self._tokens(n, prompt.startswith("BREAK")):
                if piece is None:
                    yield {"error": {"message": "broke mid-stream"}}
                    return
                text += piece  # rxf's native stream is cumulative
                usage = self._usage(prompt, i + 1)
                meta = {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}
                meta["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
                yield {"text": text, "output_ids": list(range(i + 1)), "meta_info": meta}

        return self._sse(events())
