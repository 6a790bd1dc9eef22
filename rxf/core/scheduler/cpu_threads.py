"""How many torch threads the CPU scheduler computes with, step by step: every core while the rest of
the machine leaves them idle, one core fewer for each one that other processes keep busy.

Why it adapts (benchmarks/RESULTS.md, "OpenMP threads on a busy machine", 2-core VM): two OpenMP
threads decode 1.3-1.5x faster than one while nothing else runs, but fall to 0.16-0.30 of that beside
one busy core, because libgomp's threads spin at the end of every parallel region and a descheduled
thread makes the other spin through its time slice hundreds of times a step; one thread keeps
0.86-0.99 of its rate either way. So the scheduler samples, every `window_s` of stepping, the CPU
time the machine spent outside this process (`/proc/stat`'s busy time, steal included, less this
process's own from `/proc/self/stat`: rxf's tokenizer, detokenizer and HTTP server count as others,
they need their share too) and sets `cores - ceil(others - spare)` threads, at least 1: a core counts
as free while others use less than `spare` of it. Fewer threads take effect at once (the collapse
costs most); more only after `settle` windows in a row ask for them, so a burst does not flip it.

Only where `runtime.cpu_threads` is unset, on a Linux CPU engine of one rank; without /proc the
start-up default (the cores less one) stays.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

Reading = tuple[float, float]  # (busy CPU seconds of the whole machine, of this process)


def read_proc() -> Reading:
    """Busy CPU seconds since boot of the machine (all cores) and of this process (all threads)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()  # fields after the command name, from state (3rd)
    return (sum(fields[:8]) - idle) / ticks, (int(own[11]) + int(own[12])) / ticks  # utime, stime


class CpuThreadGovernor:
    def __init__(
        self, cores: int, set_threads: Callable[[int], None], threads: int, *, window_s: float = 0.25,
        settle: int = 4, spare: float = 0.25, read: Callable[[], Reading] = read_proc,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores, self.threads = cores, threads
        self._set, self._read, self._clock = set_threads, read, clock
        self.window_s, self.settle, self.spare = window_s, settle, spare
        self._t0, self._r0 = clock(), read()
        self._want_more = 0

    @classmethod
    def for_this_machine(cls, threads: int) -> CpuThreadGovernor | None:
        """A governor over the machine's cores starting at `threads`, or None without /proc."""
        try:
            read_proc()
        except (OSError, ValueError, IndexError):
            return None
        import torch

        return cls(os.cpu_count() or 1, torch.set_num_threads, threads)

    def target(self, others: float) -> int:
        """Threads for `others` cores' worth of busy time elsewhere."""
        return max(1, min(self.cores, self.cores - math.ceil(others - self.spare)))

    def before_step(self) -> None:
        now = self._clock()
        if now - self._t0 < self.window_s:
            return
        reading = self._read()
        others = ((reading[0] - self._r0[0]) - (reading[1] - self._r0[1])) / (now - self._t0)
        self._t0, self._r0 = now, reading
        want = self.target(others)
        if want > self.threads:
            self._want_more += 1
            if self._want_more < self.settle:
                return
        self._want_more = 0
        if want != self.threads:
            logger.debug("torch threads %d -> %d (others busy %.2f cores)", self.threads, want, others)
            self.threads = want
            self._set(want)
