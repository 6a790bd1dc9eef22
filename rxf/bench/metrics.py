"""Aggregate per-request results into the benchmark's figures, and print them as a table."""

from __future__ import annotations

from typing import Any

import numpy as np

from rxf.bench.client import RequestResult


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    """mean / median / p99 in milliseconds; None when there is nothing to measure."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs are over `duration` (first send to last completion) and count successful
    requests only; latencies are over successful requests."""
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    cached = [r for r in ok if r.cached_tokens is not None]
    cached_prompt = sum(r.prompt_len for r in cached)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "input_throughput": n_in / duration if duration > 0 else 0.0,
        "output_throughput": n_out / duration if duration > 0 else 0.0,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
        # From the servers' per-request usage (cached prompt tokens / prompt tokens).
        "usage_cache_hit_rate": sum(r.cached_tokens or 0 for r in cached) / cached_prompt if cached_prompt else None,
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def format_table(summary: dict[str, Any], title: str) -> str:
    rows: list[tuple[str, Any]] = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", summary["duration_s"]),
        ("input / output tokens", f"{summary['input_tokens']} / {summary['output_tokens']}"),
        ("request throughput (req/s)", summary["request_throughput"]),
        ("input throughput (tok/s)", summary["input_throughput"]),
        ("output throughput (tok/s)", summary["output_throughput"]),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        stats = summary[key]
        rows.append((f"{name} mean / median / p99 (ms)", " / ".join(_fmt(stats[k]) for k in ("mean", "median", "p99"))))
    for key, name in (("usage_cache_hit_rate", "cache hit rate (usage)"), ("server_cache_hit_rate", "cache hit rate (server)")):
        if summary.get(key) is not None:
            rows.append((name, f"{summary[key]:.1%}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{f' {title} ':=^{width + 30}}"]
    lines += [f"{name:<{width}}  {_fmt(value)}" for name, value in rows]
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)
