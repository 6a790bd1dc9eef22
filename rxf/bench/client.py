"""Streaming clients: send one `BenchRequest`, time its chunks, count its tokens.

Timing (all `time.perf_counter`, from just before the request is sent):
  ttft  the first chunk that carries generated text;
  itl   the gaps between consecutive chunks that carry text (a chunk holding several tokens is one
        gap: that is what a user sees);
  e2e   until the stream ends.
Output tokens come from the server when it reports them (OpenAI `usage`, asked for with
`stream_options.include_usage`; rxf's `meta_info.completion_tokens`), else from tokenizing the
text received. A failure (HTTP status, error event, transport error, no text) is a result with
`ok=False`, never an exception: one bad request must not end a run.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from rxf.bench.datasets import BenchRequest

BACKENDS = ("openai", "openai-chat", "rxf")


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int | None = None  # None: the server did not say
    start: float = 0.0  # perf_counter when sent
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


@dataclass
class _Stream:
    """What a parser accumulates from one response's events."""

    text: str = ""
    first: float | None = None
    last: float = 0.0
    itl: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str = ""

    def content(self, piece: str, now: float) -> None:
        if not piece:
            return
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.text += piece

    def usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            self.cached_tokens = details["cached_tokens"]


def _openai_event(s: _Stream, event: dict[str, Any], now: float, chat: bool) -> None:
    for choice in event.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        s.content(piece or "", now)
    s.usage(event.get("usage"))


def _rxf_event(s: _Stream, event: dict[str, Any], now: float) -> None:
    # rxf's native stream is cumulative: each chunk holds all the text so far.
    s.content(event.get("text", "")[len(s.text):], now)
    meta = event.get("meta_info") or {}
    s.completion_tokens = meta.get("completion_tokens", s.completion_tokens)
    s.prompt_tokens = meta.get("prompt_tokens", s.prompt_tokens)
    s.cached_tokens = meta.get("cached_tokens", s.cached_tokens)


def build_payload(
    backend: str, model: str | None, req: BenchRequest, ignore_eos: bool, extra: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The route and JSON body for one streamed request. Greedy, so runs are repeatable."""
    if backend == "rxf":
        params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}
        return "/generate", {"text": req.prompt, "sampling_params": params, "stream": True, **extra}
    body: dict[str, Any] = {
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM/SGLang/rxf extension; other servers ignore or reject it
    if backend == "openai":
        route, body["prompt"] = "/v1/completions", req.prompt
    elif backend == "openai-chat":
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": req.prompt}]
    else:
        raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    return route, body | extra


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """SSE `data:` payloads as dicts, up to `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def send(
    client: httpx.AsyncClient,
    backend: str,
    model: str | None,
    req: BenchRequest,
    *,
    ignore_eos: bool = True,
    extra: dict[str, Any] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestResult:
    """Stream one request through `client` (whose base_url is the server root)."""
    route, body = build_payload(backend, model, req, ignore_eos, extra or {})
    s = _Stream()
    start = time.perf_counter()
    try:
        async with client.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                return RequestResult(False, req.prompt_len, start=start, error=f"HTTP {response.status_code}: {detail}")
            async for event in _events(response):
                now = time.perf_counter()
                if "error" in event:
                    s.error = json.dumps(event["error"])[:300]
                    break
                if backend == "rxf":
                    _rxf_event(s, event, now)
                else:
                    _openai_event(s, event, now, chat=backend == "openai-chat")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, req.prompt_len, start=start, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if s.error or s.first is None:
        return RequestResult(False, req.prompt_len, start=start, error=s.error or "no text in the response")
    if s.completion_tokens is not None:
        n_out = s.completion_tokens
    elif count_tokens is not None:
        n_out = count_tokens(s.text)
    else:
        n_out = len(s.itl) + 1  # one token per chunk: the best guess without a tokenizer
    return RequestResult(
        ok=True,
        prompt_len=s.prompt_tokens if s.prompt_tokens is not None else req.prompt_len,
        output_len=n_out,
        ttft=s.first - start,
        e2e=end - start,
        itl=s.itl,
        cached_tokens=s.cached_tokens,
        start=start,
    )
