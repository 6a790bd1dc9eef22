"""Profiling the steps a scheduler runs: each step's device time, the device's idle time between
steps, and (optionally) torch.profiler's trace of every kernel.

Started and stopped through `/start_profile` and `/stop_profile` (or `Runtime.start_profile` /
`stop_profile`) when `runtime.profile_dir` is set; a profile given a step count stops itself after
that many steps. Each rank writes, under `<profile_dir>/<name>/dp<d>-tp<r>/`:
- `steps.jsonl`: a line per step: its kind, requests, tokens, decode rows, the host's time to
  launch it, its device time and the device's idle time before it;
- `summary.txt`: the steps grouped by kind (prefill, extend, mixed, decode by batch size) with their
  totals, and, with kernels, torch.profiler's table of the kernels by device time;
- `trace.json.gz` (with kernels): the trace for Perfetto or chrome://tracing.

Device times come from CUDA events on the step's stream: a step's time runs from an event recorded
before its first kernel to one after its result's copy, so it includes any wait for the host inside
the step; the idle time before a step runs from the previous step's end event to this step's start
event, i.e. how long the device had nothing of ours to do. On the CPU both are host clocks (a step's
time is then its whole launch).
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rxf.core.forward import ForwardMode
from rxf.core.runner.step_io import StepBatch

logger = logging.getLogger(__name__)

# A profile without a step count keeps at most this many step records (a few hundred bytes each).
MAX_STEPS = 1_000_000


@dataclass
class _Step:
    kind: str
    requests: int
    tokens: int
    decode_rows: int
    launch_ms: float
    start: Any  # torch.cuda.Event, or a host time in seconds
    end: Any


@dataclass
class StepProfiler:
    """One profile: created by `start`, fed every launched step, written by `finish`."""

    out_dir: Path
    num_steps: int | None
    device: torch.device
    kernels: bool
    steps: list[_Step] = field(default_factory=list)
    _torch_profiler: Any = None
    _began: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, out_dir: Path, num_steps: int | None, kernels: bool, device: torch.device) -> StepProfiler:
        out_dir.mkdir(parents=True, exist_ok=True)
        prof = cls(out_dir, num_steps, device, kernels)
        if kernels:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof._torch_profiler = torch.profiler.profile(activities=activities)
            prof._torch_profiler.__enter__()
        logger.info("profiling %s steps into %s%s", num_steps or "all", out_dir, " with kernels" if kernels else "")
        return prof

    @property
    def done(self) -> bool:
        return len(self.steps) >= (self.num_steps or MAX_STEPS)

    def begin(self) -> tuple[Any, float]:
        """Called as a step's launch starts, before any of its device work is enqueued."""
        return self._mark(), time.perf_counter()

    def end(self, batch: StepBatch, begun: tuple[Any, float]) -> None:
        """Called when the step's launch has enqueued all of its device work."""
        start, host_start = begun
        decode_rows = sum(1 for n in batch.extend_lens if n == 1) if batch.mode == ForwardMode.MIXED else 0
        if batch.mode == ForwardMode.DECODE:
            decode_rows = len(batch.reqs)
        self.steps.append(_Step(
            kind=_kind(batch), requests=len(batch.reqs), tokens=batch.num_tokens, decode_rows=decode_rows,
            launch_ms=(time.perf_counter() - host_start) * 1e3, start=start, end=self._mark(),
        ))

    def _mark(self) -> Any:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3

    def finish(self) -> Path:
        """Stop, write the files, and return their folder."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        rows = []
        for i, s in enumerate(self.steps):
            idle = max(self._ms(self.steps[i - 1].end, s.start), 0.0) if i else 0.0
            rows.append({"kind": s.kind, "requests": s.requests, "tokens": s.tokens, "decode_rows": s.decode_rows,
                         "launch_ms": round(s.launch_ms, 3), "device_ms": round(self._ms(s.start, s.end), 3),
                         "idle_before_ms": round(idle, 3)})
        with open(self.out_dir / "steps.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        span = self._ms(self.steps[0].start, self.steps[-1].end) if self.steps else 0.0
        summary = [summarize_steps(rows, span)]
        if self._torch_profiler is not None:
            self._torch_profiler.__exit__(None, None, None)
            summary.append(self._write_trace())
        (self.out_dir / "summary.txt").write_text("\n\n".join(summary) + "\n")
        logger.info("profile of %d steps written to %s", len(rows), self.out_dir)
        return self.out_dir

    def _write_trace(self) -> str:
        prof = self._torch_profiler
        plain = self.out_dir / "trace.json"
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as src, gzip.open(self.out_dir / "trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)


def _kind(batch: StepBatch) -> str:
    if batch.drafts:
        return "verify"
    if batch.mode == ForwardMode.DECODE:
        # Batch sizes grouped by powers of two: 1, 2, 3-4, 5-8, ...
        return f"decode <={1 << max(len(batch.reqs) - 1, 0).bit_length()}"
    if batch.mode == ForwardMode.MIXED:
        return "mixed"
    return "extend" if any(batch.prefix_lens) else "prefill"


def summarize_steps(rows: list[dict[str, Any]], span_ms: float) -> str:
    """A table of the step records by kind, and the profile's totals."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["kind"]].append(r)
    lines = [f"{'kind':<14}{'steps':>8}{'tokens':>10}{'device ms':>12}{'ms/step':>10}{'idle ms':>10}{'launch ms':>11}"]
    for kind in sorted(groups, key=_kind_order):
        g = groups[kind]
        device = sum(r["device_ms"] for r in g)
        lines.append(
            f"{kind:<14}{len(g):>8}{sum(r['tokens'] for r in g):>10}{device:>12.1f}{device / len(g):>10.3f}"
            f"{sum(r['idle_before_ms'] for r in g):>10.1f}{sum(r['launch_ms'] for r in g):>11.1f}"
        )
    busy = sum(r["device_ms"] for r in rows)
    idle = sum(r["idle_before_ms"] for r in rows)
    lines.append(f"{len(rows)} steps over {span_ms:.1f} ms: in steps {busy:.1f} ms, idle between steps {idle:.1f} ms")
    return "\n".join(lines)


def _kind_order(kind: str) -> tuple[int, int]:
    if kind.startswith("decode"):
        return 1, int(kind.split("<=")[1])
    return 0, 0
