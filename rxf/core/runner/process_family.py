"""CPU time of the engine's other processes, as the scheduler's thread choice counts it (Linux).

The scheduler process's family: its parent (`rxf launch`'s HTTP server and tokenizer, or the
process that made a `Runtime`) and the parent's other children (the detokenizer). Their work comes
in bursts that belong to serving itself: a burst of new requests is tokenized just before the
prefill that computes them, so counting it as another program's load dropped that prefill to one
torch thread, 2x slower (benchmarks/RESULTS.md, issue 22). `cpu_threads.CpuThreads` leaves it out.

The family is found by scanning /proc for processes whose parent is ours, at most every
`RESCAN_S` (the detokenizer may start after the scheduler); a process's time counts from the
first read that found it, so a sibling found late adds only what it uses from then on.
"""

from __future__ import annotations

import os
import time

RESCAN_S = 5.0
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3, the state, first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:  # exited, or no /proc
        return None
    return data[data.rfind(b")") + 2 :].split()


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (its threads included), or None if unreadable."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def children_of(parent: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and int(fields[1]) == parent:
                pids.append(int(name))
    return pids


class ProcessFamily:
    """`cpu_s()`: CPU seconds the parent and the siblings of `pid` have used since this was made
    (0 and constant for a process without a family: one whose parent is init)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        fields = _stat_fields(self.pid)
        self.parent = int(fields[1]) if fields is not None else 0
        self._last: dict[int, float] = {}  # member -> its CPU seconds at the last read
        self._members: list[int] = []
        self._scanned = float("-inf")
        self._used = 0.0
        self.cpu_s()

    def cpu_s(self) -> float:
        if self.parent <= 1:
            return 0.0
        now = time.monotonic()
        if now - self._scanned >= RESCAN_S:
            self._members = [self.parent] + [p for p in children_of(self.parent) if p != self.pid]
            self._scanned = now
        seen = {}
        for pid in self._members:
            used = cpu_s(pid)
            if used is None:
                continue
            if pid in self._last:
                self._used += max(0.0, used - self._last[pid])
            seen[pid] = used
        self._last = seen
        return self._used
