"""A chaos load against a running rxf server: for a given time, a mix of normal clients, hostile
bodies, slow-header and slow-body clients and clients that hang up mid-stream, while `/health` and
the memory of every server process are sampled; then a check that the server let go of everything.

Used by `benchmarks/chaos.py` (the command line) and `tests/reliability`. Loopback servers only.

Each client kind loops until the time is up:
- normal: a streamed completion, a chat completion or a native `/generate` (small outputs); served
  when it answers 200 and ends properly, an error by its status or exception otherwise;
- hostile: one of the `HostileCase`s (pluggable: `load_hostile_cases` reads more from a JSON file);
  served when the status is one the case expects, an error otherwise (a 5xx, a dropped connection);
- slow_header / slow_body: trickle a request's headers (or body) a few bytes at a time; served when
  the server answers 408 and closes, outlasted when the run ends first, an error otherwise;
- disconnecting: a streamed completion hung up after a few events.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil

from rxf.testing.soak import measure_leaks


@dataclass(frozen=True)
class HostileCase:
    """A request the server must refuse cleanly: POST `body` (JSON) or `raw` bytes to `path`, and
    expect one of the `expect` statuses."""

    name: str
    path: str
    body: Any = None
    raw: bytes | None = None
    expect: tuple[int, ...] = (400,)


def default_hostile_cases(model: str) -> list[HostileCase]:
    def chat(**fields: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}

    return [
        HostileCase("malformed JSON", "/v1/chat/completions", raw=b'{"model": "x", "messages": ['),
        HostileCase("not an object", "/v1/completions", raw=b'"just a string"'),
        HostileCase("wrong type", "/v1/chat/completions", chat(max_tokens="many")),
        HostileCase("huge max_tokens", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 10**12}),
        HostileCase("huge native max_new_tokens", "/generate",
                    {"text": "hi", "sampling_params": {"max_new_tokens": 2**63}}),
        HostileCase("negative temperature", "/v1/chat/completions", chat(temperature=-1)),
        HostileCase("unknown model", "/v1/chat/completions", chat(model="no-such-model"), expect=(404,)),
        HostileCase("lone surrogate", "/v1/chat/completions",
                    raw=json.dumps(chat(messages=[{"role": "user", "content": "\ud800"}])).encode()),
        HostileCase("deep nesting", "/v1/completions", raw=b"[" * 100_000),
        HostileCase("invalid regex", "/generate", {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 2}}),
        HostileCase("too many stop strings", "/v1/completions",
                    {"model": model, "prompt": "hi", "max_tokens": 2, "stop": [str(i) for i in range(1000)]}),
        HostileCase("a million token ids", "/v1/detokenize", {"model": model, "tokens": [1] * 1_000_000}),
        HostileCase("10,000 messages", "/v1/chat/completions",
                    chat(messages=[{"role": "user", "content": "hi"}] * 10_000)),
        HostileCase("oversized body", "/v1/completions", raw=b" " * (9 << 20), expect=(413,)),
    ]


def load_hostile_cases(path: str | Path) -> list[HostileCase]:
    """Cases from a JSON list of {"name", "path", "body" (JSON) or "raw" (text), "expect": [status]}."""
    cases = []
    for item in json.loads(Path(path).read_text()):
        raw = item.get("raw")
        cases.append(HostileCase(
            item["name"], item["path"], item.get("body"), None if raw is None else raw.encode(),
            tuple(item.get("expect", [400])),
        ))
    return cases


@dataclass
class ChaosResult:
    duration_s: float
    clients: dict[str, int]
    served: Counter[str] = field(default_factory=Counter)  # by client kind
    errors: Counter[str] = field(default_factory=Counter)  # "kind: what went wrong"
    error_samples: list[str] = field(default_factory=list)
    outlasted: Counter[str] = field(default_factory=Counter)  # slow clients the run ended before the server cut
    cut_after_s: dict[str, list[float]] = field(default_factory=dict, repr=False)  # slow clients, seconds to their 408
    health_s: list[float] = field(default_factory=list, repr=False)
    health_failures: Counter[str] = field(default_factory=Counter)
    rss_mib: dict[str, list[tuple[float, float]]] = field(default_factory=dict, repr=False)  # process: (t, MiB)
    running_after: int | None = None
    leaked_before_flush: int | None = None
    slots_leaked: int | None = None

    def error(self, kind: str, what: str, detail: str = "") -> None:
        self.errors[f"{kind}: {what}"] += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {what} {detail[:600]}".rstrip())

    def summary(self) -> dict[str, Any]:
        health = sorted(self.health_s)

        def pct(q: float) -> float | None:
            return round(health[min(len(health) - 1, int(q * len(health)))] * 1000, 1) if health else None

        return {
            "duration_s": round(self.duration_s, 1),
            "clients": self.clients,
            "served": dict(self.served),
            "errors": dict(self.errors),
            "error_samples": self.error_samples,
            "outlasted_the_run": dict(self.outlasted),
            "slow_clients_cut_after_s": {k: [round(min(v), 2), round(max(v), 2)] for k, v in self.cut_after_s.items() if v},
            "health_ms": {"n": len(health), "p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0),
                          "failures": dict(self.health_failures)},
            "rss_mib": {name: {"start": s[0][1], "max": max(m for _, m in s), "end": s[-1][1]}
                        for name, s in self.rss_mib.items()},
            "running_after": self.running_after,
            "leaked_before_flush": self.leaked_before_flush,
            "slots_leaked": self.slots_leaked,
        }

    @property
    def ok(self) -> bool:
        return not self.errors and not self.health_failures and self.running_after == 0 and \
            self.leaked_before_flush == 0 and self.slots_leaked == 0


class _Run:
    def __init__(self, url: str, deadline: float, result: ChaosResult, model: str, seed: int) -> None:
        self.url = url
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.deadline = deadline
        self.result = result
        self.model = model
        self.rng = random.Random(seed)

    def running(self) -> bool:
        return time.monotonic() < self.deadline


def _stream_ok(events: list[str]) -> bool:
    """Ends with [DONE], and no event before it is an error (decoded: a generated text may read
    "error", which a substring test would take for one)."""
    if events[-1:] != ["data: [DONE]"]:
        return False
    try:
        return all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])
    except ValueError:
        return False


async def _normal(run: _Run, client: httpx.AsyncClient, n: int) -> None:
    while run.running():
        n += 1
        kind = run.rng.choice(("stream", "chat", "generate"))
        try:
            if kind == "stream":
                body = {"model": run.model, "prompt": f"Note {n}:", "max_tokens": 8, "stream": True, "seed": n}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                ok = r.status_code == 200 and _stream_ok(events)
            elif kind == "chat":
                body = {"model": run.model, "messages": [{"role": "user", "content": f"Say {n}."}], "max_tokens": 8}
                r = await client.post("/v1/chat/completions", json=body)
                ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            else:
                r = await client.post("/generate", json={"text": f"Count {n}", "sampling_params": {"max_new_tokens": 8}})
                ok = r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            run.result.error("normal", type(exc).__name__, str(exc))
            continue
        if ok:
            run.result.served["normal"] += 1
        else:
            # How a stream ended: its last two events, each cut to its tail (where finish_reason is).
            detail = r.text if kind != "stream" else " | ".join(e[-240:] for e in events[-2:])
            run.result.error("normal", f"{kind} HTTP {r.status_code}", detail)


async def _hostile(run: _Run, client: httpx.AsyncClient, cases: list[HostileCase]) -> None:
    # Encoded once: a megabyte body re-encoded per request would load the client, not the server.
    bodies = [case.raw if case.raw is not None else json.dumps(case.body).encode() for case in cases]
    while run.running():
        i = run.rng.randrange(len(cases))
        case = cases[i]
        try:
            r = await client.post(case.path, content=bodies[i], headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            run.result.error("hostile", f"{case.name}: {type(exc).__name__}", str(exc))
            continue
        if r.status_code in case.expect:
            run.result.served["hostile"] += 1
        else:
            run.result.error("hostile", f"{case.name}: HTTP {r.status_code}", r.text)


async def _slow(run: _Run, kind: str) -> None:
    """Trickle one request at a time until the server cuts it (408) or the run ends."""
    # Padded with JSON whitespace to 4 KiB: trickled at 2 bytes a second, it outlasts any body timeout.
    body = b'{"text": "slow", "sampling_params": {"max_new_tokens": 1}}'.ljust(4096)
    while run.running():
        head = f"POST /generate HTTP/1.1\r\nhost: {run.host}\r\ncontent-type: application/json\r\n"
        if kind == "slow_body":
            head += f"content-length: {len(body)}\r\n\r\n"
        pieces: Iterator[bytes] = (
            (bytes([b]) for b in body) if kind == "slow_body"
            else (f"x-slow-{i}: 1\r\n".encode() for i in itertools.count())
        )
        try:
            reader, writer = await asyncio.open_connection(run.host, run.port)
        except OSError as exc:
            run.result.error(kind, f"connect: {type(exc).__name__}", str(exc))
            await asyncio.sleep(0.5)
            continue
        start = time.monotonic()
        answer = asyncio.ensure_future(reader.read(64))
        try:
            writer.write(head.encode())
            for piece in pieces:
                done, _ = await asyncio.wait({answer}, timeout=0.5)
                if done or not run.running():
                    break
                writer.write(piece)
            if not answer.done() and not run.running():
                run.result.outlasted[kind] += 1
                continue
            first = await asyncio.wait_for(answer, 10)
        except (OSError, TimeoutError) as exc:
            run.result.error(kind, type(exc).__name__, str(exc))
            continue
        finally:
            answer.cancel()
            writer.close()
        if first.startswith(b"HTTP/1.1 408"):
            run.result.served[kind] += 1
            run.result.cut_after_s.setdefault(kind, []).append(time.monotonic() - start)
        else:
            run.result.error(kind, "no 408" if first else "closed without an answer", first.decode(errors="replace"))


async def _disconnecting(run: _Run, client: httpx.AsyncClient) -> None:
    while run.running():
        body = {"model": run.model, "prompt": "A long story:", "max_tokens": 64, "stream": True}
        hang_up_after = run.rng.randint(1, 8)
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events >= hang_up_after:
                        break
            run.result.served["disconnecting"] += 1
        except httpx.HTTPError as exc:
            run.result.error("disconnecting", type(exc).__name__, str(exc))


async def _sample_health(run: _Run, interval_s: float) -> None:
    async with httpx.AsyncClient(base_url=run.url, timeout=10) as client:
        while run.running():
            start = time.perf_counter()
            try:
                r = await client.get("/health")
                if r.status_code != 200:
                    run.result.health_failures[f"HTTP {r.status_code}"] += 1
            except httpx.HTTPError as exc:
                run.result.health_failures[type(exc).__name__] += 1
            run.result.health_s.append(time.perf_counter() - start)
            await asyncio.sleep(interval_s)


def _process_name(proc: psutil.Process, main_pid: int) -> str:
    if proc.pid == main_pid:
        return "server"
    cmdline = proc.cmdline()  # children run `python -m rxf.core.launch.child NAME`
    return cmdline[-1] if cmdline else str(proc.pid)


async def _sample_rss(run: _Run, pid: int, interval_s: float, start: float) -> None:
    main = psutil.Process(pid)
    while run.running():
        for proc in [main, *main.children(recursive=True)]:
            try:
                name, mib = _process_name(proc, pid), proc.memory_info().rss / 2**20
            except psutil.Error:  # gone meanwhile
                continue
            run.result.rss_mib.setdefault(name, []).append((round(time.monotonic() - start, 1), round(mib, 1)))
        await asyncio.sleep(interval_s)


async def run_chaos(
    url: str,
    *,
    duration_s: float = 60.0,
    server_pid: int | None = None,
    normal: int = 4,
    hostile: int = 2,
    slow_header: int = 20,
    slow_body: int = 10,
    disconnecting: int = 4,
    hostile_cases: list[HostileCase] | None = None,
    api_key: str | None = None,
    health_interval_s: float = 0.05,
    request_timeout_s: float = 30.0,
    seed: int = 0,
) -> ChaosResult:
    """Run the mix for `duration_s`, then measure leaks (idle stats, /flush_cache). `server_pid`:
    the server's main process, whose tree's RSS is sampled every second. A request unanswered
    after `request_timeout_s` is an error (a hostile one the server runs instead of refusing); the
    run ends when each client's current request has ended, at most that long after `duration_s`."""
    clients = {"normal": normal, "hostile": hostile, "slow_header": slow_header, "slow_body": slow_body,
               "disconnecting": disconnecting}
    result = ChaosResult(duration_s, clients)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=normal + hostile + disconnecting + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=request_timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        cases = hostile_cases if hostile_cases is not None else default_hostile_cases(model)
        start = time.monotonic()
        run = _Run(url, start + duration_s, result, model, seed)
        tasks = [_normal(run, client, 1000 * i) for i in range(normal)]
        tasks += [_hostile(run, client, cases) for _ in range(hostile)]
        tasks += [_slow(run, "slow_header") for _ in range(slow_header)]
        tasks += [_slow(run, "slow_body") for _ in range(slow_body)]
        tasks += [_disconnecting(run, client) for _ in range(disconnecting)]
        tasks.append(_sample_health(run, health_interval_s))
        if server_pid is not None:
            tasks.append(_sample_rss(run, server_pid, 1.0, start))
        await asyncio.gather(*tasks)
        result.duration_s = time.monotonic() - start
        result.running_after, result.leaked_before_flush, result.slots_leaked = await measure_leaks(client)
    return result
