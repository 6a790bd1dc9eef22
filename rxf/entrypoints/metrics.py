"""Prometheus metrics of one server, in its own `CollectorRegistry` (several apps can coexist).

Two sources: the TokenizerManager's observer calls (token counters, finish reasons, latencies, as
outputs reach the main process) and the scheduler's stats, read when `/metrics` is scraped (gauges).
TTFT and inter-token latency are observed for streaming requests only: a non-streaming request
receives all of its tokens in one message, so the main process cannot see when they were made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rxf.core.ipc.messages import SchedulerStats, StrOut

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass
class _Live:
    """What the metrics remember about one request while it runs."""

    start: float
    stream: bool
    last_token: float | None = None
    counted_prompt: bool = False
    finished: bool = False


class ServerMetrics:
    """Implements the TokenizerManager's `RequestObserver` protocol; `render()` is the scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("rxf:num_running_reqs", "Requests in the running batch", registry=r)
        self.queued = Gauge("rxf:num_queue_reqs", "Requests waiting to be scheduled", registry=r)
        self.token_usage = Gauge(
            "rxf:token_usage", "Share of KV slots held by running requests or locked in the cache", registry=r
        )
        self.cache_hit_rate = Gauge(
            "rxf:cache_hit_rate", "Prompt tokens served from the radix cache / all prompt tokens", registry=r
        )
        self.prompt_tokens = Counter("rxf:prompt_tokens", "Prompt tokens of started requests", registry=r)
        self.generation_tokens = Counter("rxf:generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("rxf:cached_tokens", "Prompt tokens found in the radix cache", registry=r)
        self.requests = Counter("rxf:requests", "Ended requests by finish reason", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "rxf:time_to_first_token_seconds", "Time to first token (streaming requests)",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "rxf:inter_token_latency_seconds", "Time between tokens (streaming requests)",
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "rxf:e2e_request_latency_seconds", "Arrival to last token of finished requests",
            buckets=_E2E_BUCKETS, registry=r,
        )
        self._live: dict[str, _Live] = {}

    # ---- RequestObserver: called on the event loop, cheap, never raising ----
    def on_start(self, rid: str, stream: bool, now: float) -> None:
        self._live[rid] = _Live(start=now, stream=stream)

    def on_output(self, rid: str, out: StrOut, now: float) -> None:
        live = self._live.get(rid)
        if live is None:
            return
        t = out.token
        if not live.counted_prompt:
            live.counted_prompt = True
            self.prompt_tokens.inc(t.prompt_tokens)
            self.cached_tokens.inc(t.cached_tokens)
        n = len(t.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            if live.stream and live.last_token is None:
                self.ttft.observe(now - live.start)
            elif live.stream:
                # Tokens that arrive together (stream_interval > 1) share the gap evenly.
                gap = (now - live.last_token) / n
                for _ in range(n):
                    self.itl.observe(gap)
            live.last_token = now
        if t.finished is not None:
            live.finished = True
            self.requests.labels(finish_reason=t.finished.type).inc()
            self.e2e.observe(now - live.start)

    def on_end(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is not None and not live.finished:  # the consumer went away (e.g. a disconnect)
            self.requests.labels(finish_reason="abort").inc()

    # ---- scrape ----
    def refresh(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.queued.set(stats.num_waiting)
        used = stats.total_slots - stats.free_slots - stats.evictable_slots
        self.token_usage.set(used / stats.total_slots if stats.total_slots else 0.0)
        self.cache_hit_rate.set(stats.cache_hit_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
