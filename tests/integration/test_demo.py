"""The embedded demo model (SmolLM2-135M-Instruct, fetched from PyPI and converted once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rxf import Runtime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
def test_demo_answers_paris():
    with Runtime.from_config(EXAMPLES / "demo.toml") as rt:
        out = rt.chat([{"role": "user", "content": "What is the capital of France?"}], {"max_new_tokens": 32, "temperature": 0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.slow
def test_rxf_chat_command_streams_the_answer():
    done = subprocess.run(
        [sys.executable, "-m", "rxf.entrypoints.cli", "chat", str(EXAMPLES / "demo.toml"),
         "What is the capital of France?", "--max-new-tokens", "32"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
