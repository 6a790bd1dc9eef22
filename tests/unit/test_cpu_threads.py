"""The scheduler's torch thread count when `runtime.cpu_threads` is unset on the CPU: every core
while the other processes leave them idle, one fewer while they use part of one; the engine's own
processes are not another program's load."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rxf.core.config import load_config
from rxf.core.runner import cpu_threads, process_family
from rxf.core.scheduler import process


class FakeMachine:
    """Wall clock, the machine's busy CPU seconds, this process's own and its family's, advanced by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, readable: bool = True) -> None:
        self.now = self.busy = self.own = self.family = 0.0
        self.set_to: list[int] = []
        monkeypatch.setattr(cpu_threads, "machine_busy_s", lambda: self.busy if readable else None)
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads.time, "process_time", lambda: self.own)
        monkeypatch.setattr(cpu_threads.torch, "set_num_threads", self.set_to.append)
        monkeypatch.setattr(cpu_threads.torch, "get_num_threads", lambda: self.set_to[-1] if self.set_to else 0)
        monkeypatch.setattr(cpu_threads, "_background", 0)  # no compile of another test's engine counts

    def run(self, seconds: float, own_cores: float, other_cores: float, family_cores: float = 0.0) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.family += seconds * family_cores
        self.busy += seconds * (own_cores + other_cores + family_cores)

    def cpu_s(self) -> float:  # as `ProcessFamily.cpu_s`
        return self.family


def quiet_for(m: FakeMachine, t: cpu_threads.CpuThreads, seconds: float) -> int:
    """Run quiet windows for `seconds`, a forward after each; the last thread count."""
    for _ in range(round(seconds / 0.25)):
        m.run(0.25, own_cores=t.threads, other_cores=0.02)
        threads = t.before_forward()
    return threads


def test_threads_follow_what_the_other_processes_use(monkeypatch: pytest.MonkeyPatch) -> None:
    m = FakeMachine(monkeypatch)
    t = cpu_threads.CpuThreads(2)
    assert m.set_to == [2]  # all cores until a load shows
    m.run(0.3, own_cores=2, other_cores=0.6)
    assert t.before_forward() == 1
    assert quiet_for(m, t, 1.0) == 1  # until the machine has been quiet for QUIET_S
    assert quiet_for(m, t, 1.25) == 2 and m.set_to == [2, 1, 2]
    m.run(0.1, own_cores=2, other_cores=0.6)  # shorter than a window: not sampled yet
    assert t.before_forward() == 2
    m.run(0.2, own_cores=2, other_cores=0.6)  # e.g. a busy loop: it gets 0.6 core beside two threads
    assert t.before_forward() == 1 and t.others_cores == pytest.approx(0.6)
    m.run(0.3, own_cores=1, other_cores=0.3)  # between the bounds: stays
    assert t.before_forward() == 1
    # The load came back within FLAP_S of the thread's return: the next return waits twice as long.
    assert quiet_for(m, t, 3.0) == 1
    assert quiet_for(m, t, 1.25) == 2
    assert m.set_to == [2, 1, 2, 1, 2]  # set only when the count changes
    m.run(cpu_threads.FLAP_S, own_cores=2, other_cores=0.3)  # a long while at two threads, then a load
    assert t.before_forward() == 2
    m.run(0.25, own_cores=2, other_cores=0.6)
    assert t.before_forward() == 1
    assert quiet_for(m, t, 2.25) == 2  # it did not come back soon: the wait is QUIET_S again


def test_a_load_while_the_engine_idles_is_not_what_its_forwards_meet(monkeypatch: pytest.MonkeyPatch) -> None:
    m = FakeMachine(monkeypatch)
    t = cpu_threads.CpuThreads(2)

    def forward(seconds: float, other_cores: float) -> None:
        t.before_forward()
        m.run(seconds, own_cores=t.threads, other_cores=other_cores)
        t.after_forward()

    forward(0.3, other_cores=0.02)
    m.run(2.0, own_cores=0, other_cores=1.0)  # a bench client starts while the engine waits
    forward(0.3, other_cores=0.2)  # then streams the answers of the burst it sent
    assert t.before_forward() == 2 and m.set_to == [2]
    forward(0.3, other_cores=0.2)
    # A pause shorter than IDLE_S keeps the window: a load in it counts.
    m.run(cpu_threads.IDLE_S / 2, own_cores=0, other_cores=1.0)
    assert t.before_forward() == 1
    t.after_forward()
    assert quiet_for(m, t, cpu_threads.QUIET_S + 0.25) == 2
    # A steady load through an idle stretch shows in the first window of forwards after it.
    t.after_forward()
    m.run(1.0, own_cores=0, other_cores=1.0)
    assert t.before_forward() == 2
    m.run(0.25, own_cores=2, other_cores=1.0)
    assert t.before_forward() == 1


def test_the_engines_own_processes_are_no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    m = FakeMachine(monkeypatch)
    t = cpu_threads.CpuThreads(2, family=m)
    m.run(0.3, own_cores=2, other_cores=0.05, family_cores=0.9)  # the server tokenizing a burst
    assert t.before_forward() == 2 and t.others_cores == pytest.approx(0.05)
    m.run(0.3, own_cores=2, other_cores=0.6, family_cores=0.9)
    assert t.before_forward() == 1


def test_a_process_family_is_the_parent_and_its_other_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child of this process sees this process and its other children as its family."""
    monkeypatch.setattr(process_family, "RESCAN_S", 0.0)  # a new sibling is found at the next read
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        family = process_family.ProcessFamily(sleeper.pid)
        assert family.parent == os.getpid()
        start = family.cpu_s()
        burner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                                   "while time.process_time() < end: pass\ntime.sleep(30)"])
        try:
            family.cpu_s()  # the burner found: it counts from here
            deadline = time.monotonic() + 20
            while family.cpu_s() - start < 0.3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert family.cpu_s() - start >= 0.3
        finally:
            burner.kill()
    finally:
        sleeper.kill()
    assert process_family.ProcessFamily().parent == os.getppid()


def test_a_background_compile_holds_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    m = FakeMachine(monkeypatch)
    t = cpu_threads.CpuThreads(2)
    assert quiet_for(m, t, 2.25) == 2
    with cpu_threads.compiling(2):  # our own thread compiling: it needs a core as another process would
        m.run(0.3, own_cores=2, other_cores=0)
        assert t.before_forward() == 1
        assert m.set_to[-1] == 2  # but the compile holds torch's count (its graphs guard on it)
    assert m.set_to[-1] == 2  # the count before it, restored
    m.run(0.25, own_cores=1, other_cores=0)
    assert t.before_forward() == 1 and m.set_to[-1] == 1  # the next forward sets its own
    assert quiet_for(m, t, 4.25) == 2


def test_one_core_or_no_proc_stat_keeps_the_fewer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    m = FakeMachine(monkeypatch)
    t = cpu_threads.CpuThreads(1)
    m.run(1.0, own_cores=1, other_cores=0)
    assert t.before_forward() == 1
    m = FakeMachine(monkeypatch, readable=False)
    t = cpu_threads.CpuThreads(16)
    m.run(1.0, own_cores=1, other_cores=0)
    assert t.before_forward() == 15 and m.set_to == [15]


def test_usable_cores_follow_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    # A container pinned to 2 CPUs of a 16-CPU host: os.cpu_count() says 16.
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {4, 5})
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 16)
    assert cpu_threads.usable_cores() == 2
    monkeypatch.delattr(cpu_threads.os, "sched_getaffinity")
    assert cpu_threads.usable_cores() == 16


def test_machine_busy_time_is_read_from_proc_stat() -> None:
    first = cpu_threads.machine_busy_s()
    assert first is not None and first > 0
    sum(range(2_000_000))  # some CPU time
    assert cpu_threads.machine_busy_s() >= first


def test_default_applies_on_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert process._on_cpu(load_config(None, **{"runtime.device": "cpu"}))
    assert not process._on_cpu(load_config(None, **{"runtime.device": "cuda"}))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert not process._on_cpu(load_config(None, **{"runtime.device": "auto"}))
