"""A soak load against a running rxf server: many concurrent streaming completions, some of whose
clients hang up part-way, then a check that the server let go of everything.

Used by `benchmarks/soak.py` (the command line) and by `tests/reliability`. Loopback servers only:
it is a correctness load, not a benchmark of the network.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    completed: int = 0
    disconnected: int = 0
    errors: int = 0
    hung: int = 0
    latencies_s: list[float] = field(default_factory=list, repr=False)
    error_samples: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    # After the load, once idle: slots held by neither the free list nor the tree (must be 0),
    # and slots not free after /flush_cache (must be 0).
    leaked_before_flush: int | None = None
    slots_leaked: int | None = None
    running_after: int | None = None

    def percentile(self, q: float) -> float | None:
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "latencies_s"}
        p50, p99 = self.percentile(0.5), self.percentile(0.99)
        out["p50_latency_s"] = None if p50 is None else round(p50, 3)
        out["p99_latency_s"] = None if p99 is None else round(p99, 3)
        out["mean_latency_s"] = round(statistics.fmean(self.latencies_s), 3) if self.latencies_s else None
        out["wall_s"] = round(self.wall_s, 2)
        return out


async def _one(
    client: httpx.AsyncClient, i: int, model: str, max_tokens: int, hang_up_after: int | None,
    timeout_s: float, result: SoakResult,
) -> None:
    body = {
        "model": model, "prompt": f"Request {i}: write a short note about the number {i}.",
        "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True,
    }
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                events = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        result.completed += 1
                        result.latencies_s.append(time.perf_counter() - start)
                        return
                    if "error" in json.loads(data):
                        raise RuntimeError(data[:200])
                    events += 1
                    if hang_up_after is not None and events >= hang_up_after:
                        result.disconnected += 1  # leaving the block closes the connection
                        return
                raise RuntimeError("the stream ended without [DONE]")
    except TimeoutError:
        result.hung += 1
    except Exception as exc:
        result.errors += 1
        if len(result.error_samples) < 5:
            result.error_samples.append(f"{type(exc).__name__}: {exc}")


async def _idle_stats(client: httpx.AsyncClient, timeout_s: float) -> dict[str, Any]:
    """Server stats once nothing runs (aborts land within a scheduler step or two)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await client.get("/get_server_info")).json()["stats"]
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["in_flight"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def run_soak(
    url: str,
    *,
    requests: int = 200,
    concurrency: int = 200,
    disconnect_fraction: float = 0.0,
    max_tokens: int = 8,
    api_key: str | None = None,
    request_timeout_s: float = 120.0,
    seed: int = 0,
) -> SoakResult:
    """Run the load, then measure leaks: idle stats, /flush_cache, stats again."""
    rng = random.Random(seed)
    result = SoakResult(requests=requests, concurrency=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=request_timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int, hang_up_after: int | None) -> None:
            async with gate:
                await _one(client, i, model, max_tokens, hang_up_after, request_timeout_s, result)

        # Hang up after 1..max_tokens events: anywhere from the first chunk to just before the end.
        plan = [rng.randint(1, max_tokens) if rng.random() < disconnect_fraction else None for _ in range(requests)]
        start = time.perf_counter()
        await asyncio.gather(*(gated(i, k) for i, k in enumerate(plan)))
        result.wall_s = time.perf_counter() - start
        result.running_after, result.leaked_before_flush, result.slots_leaked = await measure_leaks(client)
    return result


async def measure_leaks(client: httpx.AsyncClient, idle_timeout_s: float = 30.0) -> tuple[int, int, int | None]:
    """Once the server is idle: (requests still running or waiting, slots held by neither the free
    list nor the tree, slots not free after /flush_cache (None if the flush was refused))."""
    stats = await _idle_stats(client, idle_timeout_s)
    running = stats["num_running"] + stats["num_waiting"]
    leaked = stats["total_slots"] - stats["free_slots"] - stats["tree_slots"]
    flushed = await client.post("/flush_cache")
    if flushed.status_code != 200:
        return running, leaked, None
    stats = (await client.get("/get_server_info")).json()["stats"]
    return running, leaked, stats["total_slots"] - stats["free_slots"]
