"""The scheduler's idle heap trim (`rxf.core.launch.heap`): when it calls malloc_trim, and that the
call returns fragmented free memory to the OS on glibc."""

from __future__ import annotations

import pytest

from rxf.core.launch import heap


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


def test_trims_only_after_work_and_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    now = [100.0]
    monkeypatch.setattr(heap.time, "monotonic", lambda: now[0])
    trimmer = heap.IdleHeapTrimmer(interval_s=10.0)
    trimmer._trim = lambda pad: calls.append(pad) or 1
    trimmer.idle()
    assert calls == []  # nothing ran since start-up
    trimmer.busy()
    now[0] += 5
    trimmer.idle()
    assert calls == []  # within the interval
    now[0] += 6
    trimmer.idle()
    trimmer.idle()
    assert calls == [0]  # once: the next needs another step first
    now[0] += 20
    trimmer.idle()
    assert calls == [0]
    for _ in range(13):  # never idle: a step every 10 s trims once busy_interval_s (120 s) passed
        now[0] += 10
        trimmer.busy()
    assert calls == [0, 0]


@pytest.mark.skipif(heap._malloc_trim() is None, reason="not glibc")
def test_returns_fragmented_free_memory_to_the_os() -> None:
    # Many small blocks (malloc's heap, not mmap), then free all but every 64th: the survivors pin
    # the heap's top, so free() alone returns almost nothing.
    blocks = [bytearray(4000) for _ in range(50_000)]  # ~200 MB
    keep = blocks[::64]
    del blocks
    before = _rss_mib()
    trimmer = heap.IdleHeapTrimmer(interval_s=0.0)
    trimmer.busy()
    trimmer.idle()
    after = _rss_mib()
    assert before - after > 100, (before, after)
    assert len(keep) == 782
