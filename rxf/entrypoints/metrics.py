"""Prometheus metrics of one server, in its own `CollectorRegistry` (several apps can coexist).

Every series carries a `model_name` label (the served model name). Each figure is exported under
rxf's name and, where vLLM has one, under vLLM's too (`vllm:num_requests_running`, ...), with
vLLM's buckets, so dashboards and autoscalers written for vLLM read rxf unchanged.

Three sources: the TokenizerManager's observer calls (token counters, finish reasons, latencies, as
outputs reach the main process); the scheduler's timestamps of a request, sent with its finishing
output (queue, prefill and decode times, and the first-token time of a non-streaming request,
whose tokens all arrive in one message); and the scheduler's stats, read when `/metrics` is scraped
(gauges, preemptions). Inter-token latency is observed for streaming requests only: the gaps of a
non-streaming request are never seen (its per-request time per output token is).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rxf.core.ipc.messages import SchedulerStats, StrOut, TokenOut

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read the same.
_VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
_VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_VLLM_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)


def token_count_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (vLLM's buckets of per-request token counts)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_len:
                return out
            out.append(mantissa * scale)
        scale *= 10


class _Twins:
    """One figure under several names (rxf's and vLLM's): every update goes to each."""

    def __init__(self, *children: Any) -> None:
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


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

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        gauge, counter, histogram = self._labeled(Gauge), self._labeled(Counter), self._labeled(Histogram)
        def twins(make: Any, doc: str, *names: str) -> _Twins:
            return _Twins(*(make(name, doc) for name in names))

        self.running = twins(gauge, "Requests in the running batch", "rxf:num_running_reqs", "vllm:num_requests_running")
        self.queued = twins(
            gauge, "Requests waiting to be scheduled", "rxf:num_queue_reqs", "vllm:num_requests_waiting"
        )
        self.token_usage = twins(
            gauge, "Share of KV slots held by running requests or locked in the cache (0..1)",
            "rxf:token_usage", "vllm:kv_cache_usage_perc",
        )
        self.cache_hit_rate = gauge(
            "rxf:cache_hit_rate", "Prompt tokens served from the radix cache / all prompt tokens"
        )
        self.prompt_tokens = twins(
            counter, "Prompt tokens of started requests (each looked up in the prefix cache)",
            "rxf:prompt_tokens", "vllm:prompt_tokens", "vllm:prefix_cache_queries",
        )
        self.generation_tokens = twins(counter, "Generated tokens", "rxf:generation_tokens", "vllm:generation_tokens")
        self.cached_tokens = twins(
            counter, "Prompt tokens found in the prefix (radix) cache", "rxf:cached_tokens", "vllm:prefix_cache_hits"
        )
        self.preemptions = counter("vllm:num_preemptions", "Requests retracted (preempted) by the scheduler")
        # Speculative decoding: scheduler totals (`SpecCounters`) mirrored as counters, by stats key.
        self._from_stats: dict[str, _Twins] = {
            "retractions": _Twins(self.preemptions),
            "drafted_tokens": twins(counter, "Draft tokens proposed by speculative decoding",
                                    "rxf:spec_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
            "accepted_tokens": twins(counter, "Draft tokens accepted by verification",
                                     "rxf:spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
            "verify_steps": twins(counter, "Forwards that verified draft tokens",
                                  "rxf:spec_verify_steps", "vllm:spec_decode_num_drafts"),
        }
        self._stats_seen: dict[str, int] = {}
        r, labels = self.registry, ["model_name"]
        self._requests = Counter("rxf:requests", "Ended requests by finish reason", [*labels, "finish_reason"], registry=r)
        self._vllm_requests = Counter(
            "vllm:request_success", "Ended requests by finish reason", [*labels, "finished_reason"], registry=r
        )
        self.ttft = _Twins(
            histogram("rxf:time_to_first_token_seconds", "Arrival to first token", buckets=_TTFT_BUCKETS),
            histogram("vllm:time_to_first_token_seconds", "Arrival to first token", buckets=_VLLM_TTFT_BUCKETS),
        )
        self.itl = _Twins(
            histogram("rxf:inter_token_latency_seconds", "Time between tokens (streaming requests)",
                      buckets=_ITL_BUCKETS),
            histogram("vllm:inter_token_latency_seconds", "Time between tokens (streaming requests)",
                      buckets=_VLLM_TPOT_BUCKETS),
        )
        self.e2e = _Twins(
            histogram("rxf:e2e_request_latency_seconds", "Arrival to last token of finished requests",
                      buckets=_E2E_BUCKETS),
            histogram("vllm:e2e_request_latency_seconds", "Arrival to last token of finished requests",
                      buckets=_VLLM_LATENCY_BUCKETS),
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Decode time / (generated tokens - 1), per request",
            buckets=_VLLM_TPOT_BUCKETS,
        )
        phases = {
            "queue": "queued in the scheduler until first scheduled",
            "prefill": "first scheduled until its first token",
            "decode": "first token until the last",
            "inference": "first scheduled until the last token",
        }
        self.phase = {
            name: histogram(f"vllm:request_{name}_time_seconds", f"Seconds {doc}", buckets=_VLLM_LATENCY_BUCKETS)
            for name, doc in phases.items()
        }
        # Per-request token counts: their buckets reach the context length (`set_context_len`).
        self.request_prompt_tokens: Any = None
        self.request_generation_tokens: Any = None
        self._live: dict[str, _Live] = {}

    def _labeled(self, kind: type) -> Any:
        """A maker of `kind` series in this registry, already labeled with the model name."""

        def make(name: str, doc: str, **kwargs: Any) -> Any:
            return kind(name, doc, ["model_name"], registry=self.registry, **kwargs).labels(self.model_name)

        return make

    def set_context_len(self, max_context_len: int) -> None:
        """Called once the engine is loaded (its context length bounds the token-count buckets)."""
        histogram, buckets = self._labeled(Histogram), token_count_buckets(max_context_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request",
                                               buckets=buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request", buckets=buckets
        )

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
            self._requests.labels(self.model_name, t.finished.type).inc()
            self._vllm_requests.labels(self.model_name, t.finished.type).inc()
            self.e2e.observe(now - live.start)
            self._observe_finished(live, t)

    def _observe_finished(self, live: _Live, t: TokenOut) -> None:
        """The scheduler's times of a finished request (see `TokenOut.timings`)."""
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(t.prompt_tokens)
            self.request_generation_tokens.observe(t.completion_tokens)
        if t.timings is None:
            return
        queued, scheduled, first, last = t.timings
        if first is not None and not live.stream:
            self.ttft.observe(max(first - live.start, 0.0))
        if scheduled is None or queued is None or last is None:
            return
        self.phase["queue"].observe(scheduled - queued)
        self.phase["inference"].observe(last - scheduled)
        if first is None:
            return
        self.phase["prefill"].observe(first - scheduled)
        self.phase["decode"].observe(last - first)
        if t.completion_tokens > 1:
            self.tpot.observe((last - first) / (t.completion_tokens - 1))

    def on_end(self, rid: str) -> None:
        live = self._live.pop(rid, None)
        if live is not None and not live.finished:  # the consumer went away (e.g. a disconnect)
            self._requests.labels(self.model_name, "abort").inc()
            self._vllm_requests.labels(self.model_name, "abort").inc()

    # ---- scrape ----
    def refresh(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.queued.set(stats.num_waiting)
        used = stats.total_slots - stats.free_slots - stats.evictable_slots
        self.token_usage.set(used / stats.total_slots if stats.total_slots else 0.0)
        self.cache_hit_rate.set(stats.cache_hit_rate)
        # The scheduler counts these (retractions are vLLM's preemptions) since it started.
        for key, series in self._from_stats.items():
            total, seen = int(stats.extra.get(key, 0)), self._stats_seen.get(key, 0)
            if total > seen:
                series.inc(total - seen)
                self._stats_seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
