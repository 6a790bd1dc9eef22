"""The scheduler's torch thread count when `runtime.cpu_threads` is unset on the CPU."""

from __future__ import annotations

import pytest

from rxf.core.config import load_config
from rxf.core.scheduler import process


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (16, 15), (None, 1)])
def test_default_leaves_a_core(monkeypatch: pytest.MonkeyPatch, cores: int | None, threads: int) -> None:
    monkeypatch.setattr(process.os, "cpu_count", lambda: cores)
    assert process.default_cpu_threads() == threads


def test_default_applies_on_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert process._on_cpu(load_config(None, **{"runtime.device": "cpu"}))
    assert not process._on_cpu(load_config(None, **{"runtime.device": "cuda"}))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert not process._on_cpu(load_config(None, **{"runtime.device": "auto"}))
