"""Step profiles (`Runtime.start_profile` / `stop_profile`, `rxf/core/runner/step_profiler.py`) through
a real scheduler process on a tiny checkpoint: the step records add up to the work that was asked for."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from rxf import Runtime

GREEDY = {"temperature": 0, "ignore_eos": True}


def _config(path, **runtime):
    return {
        "model": {"path": str(path)},
        "runtime": {"device": "cpu", "cpu_threads": 1, **runtime},
        "attention": {"backend": "torch_native"},
        "cache": {"max_total_tokens": 4096},
    }


@pytest.fixture(scope="module")
def rt(tiny_llama, tmp_path_factory):
    with Runtime.from_config(_config(tiny_llama, profile_dir=str(tmp_path_factory.mktemp("profiles")))) as runtime:
        yield runtime


def _steps(folder: str) -> list[dict]:
    lines = (Path(folder) / "dp0-tp0" / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_profile_records_every_step_of_the_work(rt):
    prompts = [list(range(100 * i + 10, 100 * i + 10 + n)) for i, n in enumerate((5, 17, 9))]
    new_tokens = 6
    folder = rt.start_profile()
    rt.generate(input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, **GREEDY})
    assert rt.stop_profile() == folder
    steps = _steps(folder)
    # Every prompt token is computed once (nothing was cached before: the prompts are new), and each
    # request then decodes one token a step after the first, which its prefill sampled.
    prefill = [s for s in steps if s["kind"] in ("prefill", "extend", "mixed")]
    decoded_rows = sum(s["decode_rows"] for s in steps)
    assert sum(s["tokens"] for s in steps) - decoded_rows == sum(map(len, prompts))
    assert decoded_rows == len(prompts) * (new_tokens - 1)
    assert prefill and all(s["device_ms"] > 0 and s["idle_before_ms"] >= 0 for s in steps)
    summary = (Path(folder) / "dp0-tp0" / "summary.txt").read_text()
    assert f"{len(steps)} steps over" in summary
    assert not (Path(folder) / "dp0-tp0" / "trace.json.gz").exists()  # no kernels asked for


def test_a_profile_of_n_steps_stops_by_itself_with_its_kernel_trace(rt):
    folder = rt.start_profile(num_steps=3, kernels=True)
    rt.generate(input_ids=[list(range(20, 32))], sampling_params={"max_new_tokens": 8, **GREEDY})
    assert len(_steps(folder)) == 3
    with gzip.open(Path(folder) / "dp0-tp0" / "trace.json.gz") as f:
        trace = json.load(f)
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "aten::mm" in (Path(folder) / "dp0-tp0" / "summary.txt").read_text()
    with pytest.raises(ValueError, match="no profile is running"):
        rt.stop_profile()


def test_a_second_start_is_refused_while_one_runs(rt):
    folder = rt.start_profile()
    with pytest.raises(ValueError, match="already running"):
        rt.start_profile()
    assert rt.stop_profile() == folder


def test_profiling_is_refused_without_a_profile_dir(tiny_llama):
    with Runtime.from_config(_config(tiny_llama)) as runtime:
        with pytest.raises(ValueError, match="runtime.profile_dir"):
            runtime.start_profile()
