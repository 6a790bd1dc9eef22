"""What one kernel-to-kernel hand-off costs inside a decode step's CUDA graph, with and without
programmatic dependent launch (`rxf/core/runner/pdl.py`): a chain of dependent Triton kernels that
move almost no data, so that their time is the hand-off itself.

    python benchmarks/gpu_hops.py [--kernels 256] [--programs 1,16,132,528] [--reps 20]

Why: a batch-1 step of Qwen3-30B-A3B stands ~1.5 ms above its bandwidth floor on the H100 and on the
H200 alike (benchmarks/RESULTS.md, 2026-12-06), ~32 us a layer of 7 launches. Fusing launches is the
lever that is left; this says what each launch removed is worth before any fusion is written.

Each kernel of a chain reads what the kernel before it wrote and writes for the next:
- `plain`: program p stores x[p] + 1 to y[p] (one dependent load and store a program);
- `handoff`: each program stores its value as a partial, then `gemv_kernel`'s split-K hand-off (a CTA
  barrier, an acq_rel atomic on a counter; the last program to arrive reads every partial with `.cg`
  loads, resets the counter and writes y), as the GEMV, routing, attention and MoE kernels end.
With PDL each program calls `gdc_launch_dependents()` and then `gdc_wait()` first, as rxf's kernels
do. GPU time per kernel: the chain captured in one graph (alternating two buffers) and replayed.
Prints a table and writes $OUT/gpu_hops.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from gpu_gemv import graph_us


@triton.jit
def _hop(X, Y, Partials, Counter, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, HANDOFF: tl.constexpr,
         PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    p = tl.program_id(0)
    value = tl.load(X + p) + 1.0
    if HANDOFF:
        tl.store(Partials + p, value)
        tl.debug_barrier()  # the partial's store precedes the counter update
        arrived = tl.atomic_add(Counter, 1, sem="acq_rel")
        if arrived == PROGRAMS - 1:  # the last program sums the partials and writes every y
            lanes = tl.arange(0, BLOCK)
            total = tl.sum(tl.load(Partials + lanes, mask=lanes < PROGRAMS, other=0.0, cache_modifier=".cg"),
                           axis=0)
            tl.store(Counter, 0)
            tl.store(Y + lanes, tl.zeros((BLOCK,), dtype=tl.float32) + total / PROGRAMS, mask=lanes < PROGRAMS)
    else:
        tl.store(Y + p, value)


def chain_us(kernels: int, programs: int, handoff: bool, pdl: bool, reps: int) -> float:
    """GPU time per kernel of a `kernels`-long chain, replayed from one CUDA graph."""
    dev = torch.device("cuda")
    bufs = [torch.zeros(programs, device=dev) for _ in range(2)]
    partials = torch.zeros(programs, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    block = triton.next_power_of_2(programs)

    def run() -> None:
        for i in range(kernels):
            _hop[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], partials, counter, PROGRAMS=programs, BLOCK=block,
                              HANDOFF=handoff, PDL=pdl, launch_pdl=pdl)

    us = graph_us(lambda _: run(), [counter], reps)  # one chain per replay; compiled before the capture
    assert not counter.any(), "every hand-off resets its counter"
    return us / kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=256)
    ap.add_argument("--programs", default="1,16,132,528")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    pdl_ok = torch.cuda.get_device_capability()[0] >= 9
    print(f"{torch.cuda.get_device_name()}: us per kernel, a chain of {args.kernels} in one graph")
    print(f"{'variant':<8} {'programs':>8} {'plain':>8} {'pdl':>8}")
    results: dict[str, dict[int, dict[str, float]]] = {}
    for variant in ("plain", "handoff"):
        results[variant] = {}
        for programs in (int(p) for p in args.programs.split(",")):
            row = {"plain": chain_us(args.kernels, programs, variant == "handoff", False, args.reps)}
            if pdl_ok:
                row["pdl"] = chain_us(args.kernels, programs, variant == "handoff", True, args.reps)
            results[variant][programs] = row
            print(f"{variant:<8} {programs:>8} {row['plain']:>8.2f} {row.get('pdl', float('nan')):>8.2f}", flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_hops.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), **results}, indent=1))


if __name__ == "__main__":
    main()
