"""The scheduler's torch thread count on the CPU, chosen before each forward from what the rest of
the machine uses (`runtime.cpu_threads` unset).

All cores while the other processes leave them idle; one fewer once they take half a core. Two
threads on two cores are 1.3-2x faster than one on a quiet machine (decode 1.3-1.5x, prefill 2x),
but libgomp's threads spin at the end of each parallel region: beside another busy process one of
them is descheduled while its partner spins, and a forward of hundreds of regions collapses
(prefill of 4 x 256 tokens 10.5 s against 2.2 s for one thread on the busy 2-core VM; decode to
16-29% of one thread's rate). One thread has no team to wait for (benchmarks/RESULTS.md, issue 22).

What the others use is sampled at most every `SAMPLE_S`: the machine's busy time (`/proc/stat`:
everything but idle and iowait, steal included) less this process's own CPU time and its family's
(`process_family`: the HTTP server and tokenizer, the detokenizer), over the wall time since the
last sample. The family's work comes in short bursts that are part of serving (a burst of requests
is tokenized just before their prefill); counted as a load, it sent the prefills of a served burst
to one thread, 2x slower. A forward starts at all cores (no history says otherwise); without
`/proc/stat` the count stays at the fewer threads. A window that spans an idle stretch of the engine
(`IDLE_S`) is dropped: the load it saw met no forward.

torch's thread count is the process's, not a thread's, and torch.compile guards on it: a graph
compiled at one count serves forwards at that count only. So a thread of this process that
compiles (`compiling(n)`) holds the count at `n` until it is done, and the forwards meanwhile run
at `n` too (the compiles warm the fewer count first: the count a forward beside a busy compiling
thread should have).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

from rxf.core.runner.process_family import ProcessFamily

logger = logging.getLogger(__name__)

SAMPLE_S = 0.2  # shortest window between two samples of the machine's use
# Cores the others may use before a forward gives up a thread (at once: one busy window), and the
# use below which the thread is taken back, once it has stayed that low for `QUIET_S`. The costs are
# uneven, so the way back is slow: a window of two threads beside a busy process costs several
# times what a window of one thread on an idle core forgoes. Beside a process busy a fixed share of
# every 20 ms, two threads still beat one up to half a core (demo model, bf16, 2-core VM: prefill of
# 4 x 128 tokens 543 vs 743 ms at a quarter, 570 vs 765 at a half; decode of 16 even at a half) and
# lose only beside a whole one (1077 vs 730 ms; decode 105 vs 251 tok/s): a bench client on the same
# machine streaming 16 answers uses about a fifth.
BUSY_CORES = 0.45
IDLE_CORES = 0.2
QUIET_S = 2.0
# A load that returns within `FLAP_S` of taking the thread back doubles the quiet time asked next
# (up to `MAX_QUIET_S`): a bursty neighbour keeps the fewer threads instead of meeting two threads
# at every burst. `FLAP_S` at all cores without a load resets it.
FLAP_S = 10.0
MAX_QUIET_S = 60.0
# An idle stretch this long (from a forward's end to the next one's start) ends the window: what the
# others did while the engine waited is not what its forwards will meet. A bench client starting on
# the machine (~1 core for a second or two, then a fifth while it streams) sent the first forwards
# of each of its runs, the prefills of the burst it then sent, to one thread for QUIET_S. A steady
# load shows again in the first window of forwards.
IDLE_S = 0.5
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_background = 0  # threads of this process compiling now (`compiling`)
_count_lock = threading.Lock()  # held to read `_background` and set torch's count as one step
_compile_lock = threading.RLock()  # one compile at a time (each holds torch's count at its own)


@contextlib.contextmanager
def compiling(threads: int) -> Iterator[None]:
    """Inside: the calling thread compiles with torch.compile at torch thread count `threads` (what
    dynamo's graphs guard on and Inductor generates its C++ kernels for); no `CpuThreads` changes
    the count meanwhile. Compiles of other threads wait (two engines of one process, a draft's and
    its target's, each warm their kernels up); a nested one must ask for the same count. Inside, do
    not wait for another thread that compiles."""
    global _background
    with _compile_lock:
        with _count_lock:
            _background += 1
            saved = torch.get_num_threads()
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            with _count_lock:
                _background -= 1
                if not _background:
                    torch.set_num_threads(saved)


def start_background_compile(compile_: Callable[[], None], name: str) -> None:
    """Run `compile_` (which enters `compiling`) in a thread of its own. An interpreter that exits
    while Inductor compiles aborts (std::terminate): exiting waits for it.

    Forwards meanwhile run 10-20x slower than alone (demo model, eager batch-1 steps of 320-680 ms
    against ~30 ms, measured): dynamo's tracing is Python that holds the GIL, and a forward needs it
    back after each of its hundreds of ops. Neither nice 19 for the compiling thread nor a 0.1 ms
    GIL switch interval changed that (measured), hence `runtime.cpu_compile`'s default."""
    thread = threading.Thread(target=compile_, name=name, daemon=True)
    thread.start()
    atexit.register(thread.join)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a container pinned to 2 CPUs of a
    larger host sees the host's count in `os.cpu_count()`, and torch's default follows the affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # (no affinity on this OS)
        return os.cpu_count() or 1


def machine_busy_s() -> float | None:
    """Seconds of CPU time every process of the machine has used since boot (None: unreadable)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice: counted in user already]
    ticks = [int(x) for x in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) * _TICK_S


class CpuThreads:
    """Sets torch's thread count to `most` or `most - 1` before each forward (`before_forward`).
    `family`: the engine's other processes, whose CPU time is not another program's load."""

    def __init__(self, most: int, family: ProcessFamily | None = None) -> None:
        self.most = max(1, most)
        self.fewer = max(1, self.most - 1)
        self.family = family
        self._last = self._sample()
        self.threads = self.most if self._last is not None else self.fewer
        torch.set_num_threads(self.threads)
        self.others_cores = 0.0  # the others' use over the last window, in cores
        self._quiet_since: float | None = None  # start of the current run of quiet windows
        self._quiet_s = QUIET_S  # how long a run of quiet windows must last to take the thread back
        self._raised_at = float("-inf")  # when the count last went up to `most`
        self._idle_from: float | None = None  # the end of the last forward, until the next starts

    def _sample(self) -> tuple[float, float, float] | None:
        """(wall time, the machine's busy CPU seconds, the part of them this engine's processes used)."""
        busy = machine_busy_s()
        if busy is None:
            return None
        own = time.process_time() + (self.family.cpu_s() if self.family is not None else 0.0)
        return time.monotonic(), busy, own

    @property
    def counts(self) -> tuple[int, ...]:
        """The thread counts a forward may run at, the fewer (a forward's first) first."""
        return tuple(dict.fromkeys((self.fewer, self.most)))

    def before_forward(self) -> int:
        """Re-sample when the window is over and set torch's thread count, unless a compile holds it
        (`compiling`); returns the count chosen."""
        threads = self._choose()
        self._idle_from = None
        with _count_lock:
            if not _background and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        return threads

    def after_forward(self) -> None:
        self._idle_from = time.monotonic()

    def _choose(self) -> int:
        if self._last is None or self.most == self.fewer:
            return self.threads
        now = time.monotonic()
        if self._idle_from is not None and now - self._idle_from >= IDLE_S:
            self._last = self._sample() or self._last  # a new window, no decision
            return self.threads
        if now - self._last[0] < SAMPLE_S:
            return self.threads
        sample = self._sample()
        if sample is None:
            return self.threads
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        self.others_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        threads = self.threads
        if self.others_cores >= BUSY_CORES or _background:
            threads, self._quiet_since = self.fewer, None
            if self.threads == self.most:  # a load returned: came back soon, the next wait is longer
                soon = t1 - self._raised_at < FLAP_S
                self._quiet_s = min(2 * self._quiet_s, MAX_QUIET_S) if soon else QUIET_S
        elif self.others_cores < IDLE_CORES:
            self._quiet_since = t0 if self._quiet_since is None else self._quiet_since
            if self.threads == self.fewer and t1 - self._quiet_since >= self._quiet_s:
                threads, self._raised_at = self.most, t1
        else:
            self._quiet_since = None
        if threads != self.threads:
            logger.debug("torch threads %d -> %d (other processes use %.2f cores)", self.threads, threads, self.others_cores)
            self.threads = threads
        return threads
