"""The CPU scheduler's thread governor (`rxf/core/scheduler/cpu_threads.py`) on scripted readings of
the machine's and this process's busy time, and on this machine's real /proc."""

from __future__ import annotations

import os

import pytest

from rxf.core.scheduler.cpu_threads import CpuThreadGovernor, read_proc


class Script:
    """A clock that advances 0.25 s per window and readings in which others use `others` cores."""

    def __init__(self) -> None:
        self.now, self.busy, self.ours = 0.0, 0.0, 0.0

    def clock(self) -> float:
        return self.now

    def read(self) -> tuple[float, float]:
        return self.busy, self.ours

    def advance(self, others: float, own: float = 1.0) -> None:
        self.now += 0.25
        self.busy += 0.25 * (others + own)
        self.ours += 0.25 * own


def _governor(script: Script, cores: int = 2, threads: int = 1) -> tuple[CpuThreadGovernor, list[int]]:
    calls: list[int] = []
    return CpuThreadGovernor(cores, calls.append, threads, read=script.read, clock=script.clock), calls


def test_quiet_machine_gets_every_core_after_settling_and_a_busy_core_takes_one_at_once() -> None:
    s = Script()
    gov, calls = _governor(s)
    for _ in range(3):  # three quiet windows: not yet
        s.advance(others=0.05, own=1.9)
        gov.before_step()
    assert gov.threads == 1 and calls == []
    s.advance(others=0.05, own=1.9)
    gov.before_step()
    assert gov.threads == 2 and calls == [2]
    s.advance(others=1.0)  # a spinning neighbour appears: back to one thread in the same window
    gov.before_step()
    assert gov.threads == 1 and calls == [2, 1]


def test_a_burst_does_not_flip_it_and_calls_within_a_window_do_nothing() -> None:
    s = Script()
    gov, calls = _governor(s)
    for others in (0.0, 0.0, 0.6, 0.0, 0.0, 0.0):  # the busy window resets the count
        s.advance(others)
        gov.before_step()
        gov.before_step()  # same instant: no new reading
    assert calls == [] and gov.threads == 1


@pytest.mark.parametrize(("cores", "others", "want"), [(2, 0.2, 2), (2, 0.3, 1), (2, 1.8, 1), (8, 0.0, 8),
                                                         (8, 2.1, 6), (8, 7.9, 1), (1, 0.0, 1)])
def test_target_leaves_a_core_per_busy_core_elsewhere(cores: int, others: float, want: int) -> None:
    gov, _ = _governor(Script(), cores=cores)
    assert gov.target(others) == want


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc")
def test_proc_readings_grow_with_this_process_busy_time() -> None:
    busy0, ours0 = read_proc()
    end = sum(range(3_000_000))  # some CPU work of our own
    busy1, ours1 = read_proc()
    assert end > 0 and ours1 > ours0 and busy1 - busy0 >= ours1 - ours0 - 0.02
