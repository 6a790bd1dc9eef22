"""`rxf bench`: serving benchmarks against any OpenAI-compatible server (`serve`) or the engine
in-process (`offline`), on generated or ShareGPT workloads."""

from __future__ import annotations

from rxf.bench.client import RequestResult
from rxf.bench.datasets import BenchRequest

__all__ = ["BenchRequest", "RequestResult"]
