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

Off unless `RXF_PDL=1`. On the H200 it compiles and its kernel tests pass
(tests/gpu/test_decode_kernels_gpu.py), and batch-1 decode of the Llama-3-8B shape went 207.6 ->
217.8 tok/s (`benchmarks/gpu_session.sh ab`; benchmarks/RESULTS.md, issue 17). The bf16 greedy
tests of tests/gpu/test_cuda_graph_gpu.py failed with it until `rmsnorm_kernel` took FlashInfer's
rounding (it had `forward_native`'s, while prefill runs FlashInfer's norm); with that they pass, as
do the overlap, Qwen3, MoE and decode-kernel GPU tests under `RXF_PDL=1`, and (2026-12-03) the
EAGLE-3, speculative-graph, Gemma, gpt-oss, LLaVA, FP8-KV and most quantized tests. A later run
(2026-12-03, tests/gpu in two bounded calls) passed 250 tests under it, the CUDA-graph replay and
mixed-prefill tests and the triton attention-feature cases among them; one feature test's own bug
(sinks left on the CPU) and the overlap test failed, the latter not from PDL: the suite stage's
RXF_CACHE__MAX_TOTAL_TOKENS outranked its 240-token pool, so nothing retracted; alone on the H200 it
passes under RXF_PDL=1 and 0 (2026-12-03), and it now passes its pool as an override. No
FlashInfer case has run with it yet (their JIT compiles outlast a call): it stays off until the
whole suite has. With Triton GEMVs for every projection it is the fastest batch-1 setting measured
(221.2 and 219.6 tok/s in two calls, 83-84% of the all-weights roofline).
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
