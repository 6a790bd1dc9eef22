"""Programmatic dependent launch (PDL, compute capability 9.0 and later) for rxf's decode kernels.

A kernel launched with PDL may start while the kernel before it in the stream still runs: its
programs are scheduled once every program of the previous kernel has called
`gdc_launch_dependents()` (or exited). At batch 1 a decode step is ~360 kernels of a few
microseconds each, so what a kernel can do before its input exists is worth having: a projection
streams its first weight tiles, every kernel hides its launch and start-up.

Invariant of every kernel compiled with `PDL` (and launched with `launch_pdl=PDL`): before
`gdc_wait()` it reads nothing that an earlier kernel writes (only weights and other tensors fixed at
load, and the forward's batch metadata: sequence lengths, pool rows and slots, positions, split
counts, which the host and kernels launched without PDL write before the forward's first PDL launch,
so before any PDL kernel of it starts) and writes nothing; `gdc_wait()` returns once the previous kernel has completed and its memory
is visible, which (each kernel waiting in turn) means every earlier kernel of the stream. The one
exception is a pair that says so: a kernel that calls `gdc_launch_dependents()` only after its own
`gdc_wait()` lets the next one start only once every kernel before it has completed, so that next
kernel may read their outputs (past L1, `.cg`) before its wait (the MoE decode kernels,
`fused_moe_decode.py`: the down kernel reads the routing's expert ids). Kernels
launched without PDL (cuBLAS, torch's own) keep the stream's plain ordering around them.

On by default on compute capability 9.0 and later; `RXF_PDL=0` turns it off (any value but 0, 1 and
empty is refused). On the H200 batch-1 decode of the Llama-3-8B shape went 207.6 -> 217.8 tok/s with it
(2026-12-03); with the Triton GEMV for every projection (the default on Hopper since, `layers/gemv.py`)
it is the fastest batch-1 setting measured. It was opt-in until the GPU suite had passed under it:
the bf16 greedy tests of tests/gpu/test_cuda_graph_gpu.py needed `rmsnorm_kernel` to take
FlashInfer's rounding; a 36-row graph captured with speculation off and a feature test's sinks left
on the CPU were bugs it surfaced, not races. On 2026-12-06 (an H100) every GPU test but the FlashInfer
cases passed with both as defaults in one run (424, and one bf16 score bound widened,
tests/gpu/test_cuda_graph_gpu.py's BF16_GAP_RATIO), and the FlashInfer window / cap / sink cases (44)
in another (benchmarks/RESULTS.md). Kernels launched without PDL (cuBLAS, FlashInfer's, NCCL's,
torch's own) wait for the whole kernel before them as usual, so mixing them with PDL launches needs
nothing of them.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "RXF_PDL"


@functools.cache
def _supported(index: int) -> bool:
    value = os.environ.get(ENV) or "1"  # unset or empty: the default
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: 1 (the default on compute capability 9.0 and later) or 0 (off)")
    return value == "1" and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a decode kernel over `t`'s device launches with PDL."""
    return t.is_cuda and _supported(t.device.index if t.device.index is not None else torch.cuda.current_device())
