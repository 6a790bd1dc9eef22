"""Programmatic dependent launch (PDL, compute capability 9.0 and later) for rxf's decode kernels.

A kernel launched with PDL may start while the kernel before it in the stream still runs: its
programs are scheduled once every program of the previous kernel has called
`gdc_launch_dependents()` (or exited). At batch 1 a decode step is ~360 kernels of a few
microseconds each, so what a kernel can do before its input exists is worth having: a projection
streams its first weight tiles, every kernel hides its launch and start-up.

Invariant of every kernel compiled with `PDL` (and launched with `launch_pdl=PDL`): before
`gdc_wait()` it reads nothing that an earlier kernel writes (only weights and other tensors fixed at
load) and writes nothing; `gdc_wait()` returns once the previous kernel has completed and its memory
is visible, which (each kernel waiting in turn) means every earlier kernel of the stream. Kernels
launched without PDL (cuBLAS, torch's own) keep the stream's plain ordering around them.

Off unless `RXF_PDL=1`: written in a session without a GPU, so neither its speed nor the compiled
kernels are measured yet (`benchmarks/gpu_session.sh ab` runs batch-1 decode with it off and on, and
tests/gpu/test_decode_kernels_gpu.py checks a PDL graph against the same kernels without it); the
default changes once those figures exist.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "RXF_PDL"


@functools.cache
def _supported(index: int) -> bool:
    return os.environ.get(ENV, "0") == "1" and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a decode kernel over `t`'s device launches with PDL."""
    return t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())
