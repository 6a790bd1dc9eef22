"""The decode projections at batch 1-8: cuBLAS vs cuBLASLt vs rxf's Triton GEMV (a sweep of its
settings), for `gpu_profile.py --phases gemv`. It ends with the `RXF_GEMV` value the figures favour.

Every candidate computes what the engine needs from that projection: gate_up includes SiLU·mul
(cuBLAS + the separate SiluAndMul launch, or the GEMV's fused epilogue) and lm_head includes the float32
cast (F.linear + .float(), torch.mm with out_dtype, or the GEMV writing float32). Times are GPU time
per call as a decode graph pays it: `copies` calls, one per rotating weight copy (>= 2 GiB in
flight, so L2 holds none), captured in one CUDA graph and replayed; launch gaps between a
candidate's kernels count. The cuBLAS baseline and each role's best Triton setting are also traced
with torch.profiler (sum of kernel durations, kernel names), as the earlier RESULTS figures were.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import gpu_decode as gd
import torch
import torch.nn.functional as F

BATCHES = (1, 2, 4, 8)
TOP = 6  # Triton settings (the fastest at batch 1) timed at every batch
MARGIN = 0.97  # suggest the GEMV for a role only when it takes under 97% of cuBLAS's time over BATCHES
DEVICE = torch.device("cuda")


def _sweep(role: str) -> list[Any]:
    from rxf.plugins.models.layers.gemv import GemvSettings

    # Small grids: each setting is a Triton compile (~1 s) of the GPU lease.
    if role == "gate_up_proj":  # 224+ column blocks at block_n 64: little need to split K
        grid = itertools.product((32, 64), (256,), (1, 2), (4,))
    elif role == "lm_head":  # a 1 GB stream: only the epilogue (float32 out, no cast kernel) can win
        grid = itertools.product((64, 128), (256,), (1,), (4,))
    else:
        grid = itertools.product((16, 32, 64), (256,), (2, 4, 8), (4,))
    tiles = [GemvSettings(n, k, s, st, 4) for n, k, s, st in grid]
    # The row kernel (batch 1; larger batches fall back to the tile kernel with the same blocks): two
    # weight tiles and a float32 product tile per thread in registers, so small tiles and more warps.
    shapes_ = ((16, 256, 4), (16, 512, 8), (32, 256, 8), (32, 512, 8))
    splits = (1,) if role == "lm_head" else (1, 2) if role == "gate_up_proj" else (1, 2, 4)
    rows = [GemvSettings(n, k, s, 2, w, row=True) for (n, k, w), s in itertools.product(shapes_, splits)]
    return tiles + rows


def shapes(p: gd.Preset) -> dict[str, tuple[int, int]]:
    """role -> (N, K) of its weight."""
    hd = p.hd
    return {"qkv_proj": ((p.heads + 2 * p.kv_heads) * hd, p.hidden), "o_proj": (p.hidden, p.heads * hd),
            "gate_up_proj": (2 * p.intermediate, p.hidden), "down_proj": (p.hidden, p.intermediate),
            "lm_head": (p.vocab, p.hidden)}


@contextlib.contextmanager
def _blas(library: str) -> Iterator[None]:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def graph_us(fn: Callable[[torch.Tensor], torch.Tensor], ws: list[torch.Tensor], reps: int = 10) -> float:
    """GPU time per call: one call per weight copy, captured in one graph, replayed `reps` times."""
    for w in ws[:2]:
        fn(w)  # compile / pick kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(ws))


def _candidates(role: str, x: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from rxf.plugins.models.layers import SiluAndMul

    act = SiluAndMul()
    if role == "gate_up_proj":
        return {"cublas": lambda w: act(F.linear(x, w))}
    if role == "lm_head":
        out = {"cublas": lambda w: F.linear(x, w).float()}
        with contextlib.suppress(RuntimeError):  # aten::mm.dtype: CUDA builds of recent torch
            torch.mm(x, x.new_zeros(x.shape[1], 16), out_dtype=torch.float32)
            out["mm_out_f32"] = lambda w: torch.mm(x, w.t(), out_dtype=torch.float32)
        return out
    return {"cublas": lambda w: F.linear(x, w)}


def _reference(role: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    ref = F.linear(x.float(), w.float())
    if role == "gate_up_proj":
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    return ref


def _triton_fn(role: str, x: torch.Tensor, settings: Any, w0: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from rxf.plugins.models.layers.gemv import DecodeGemv

    op = DecodeGemv(settings, w0, gated=role == "gate_up_proj",
                    out_dtype=torch.float32 if role == "lm_head" else None)
    return lambda w: op(x, w, None)


def _time(role: str, name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
          ws: list[torch.Tensor], ref: torch.Tensor) -> float | str:
    """graph_us of a candidate whose output matches the float32 reference, else why not."""
    try:
        ctx = _blas("cublaslt") if name == "cublaslt" else contextlib.nullcontext()
        with ctx:
            out = fn(ws[0]).float()
            err = ((out - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                return f"error {err:.2e}"
            return round(graph_us(fn, ws), 2)
    except Exception as e:  # a setting Triton cannot compile here (e.g. shared memory)
        return f"failed: {type(e).__name__}: {e}"[:120]


def _role(role: str, n: int, k: int) -> dict[str, Any]:
    copies = max(2, min(8, (2 << 30) // (n * k * 2)))
    ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    sweep = {s.label: s for s in _sweep(role)}
    rows: dict[int, dict[str, float | str]] = {}
    for m in BATCHES:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        ref = _reference(role, x, ws[0])
        base = _candidates(role, x)
        fns = {**base, "cublaslt": base["cublas"]}
        if m == 1:
            labels = list(sweep)
        else:  # the fastest settings at batch 1
            timed = {k_: v for k_, v in rows[1].items() if k_ in sweep and isinstance(v, float)}
            labels = sorted(timed, key=timed.get)[:TOP]
        fns.update({label: _triton_fn(role, x, sweep[label], ws[0]) for label in labels})
        rows[m] = {name: _time(role, name, fn, x, ws, ref) for name, fn in fns.items()}
        triton = {k_: v for k_, v in rows[m].items() if k_ in sweep and isinstance(v, float)}
        best = min(triton, key=triton.get) if triton else None
        line = "  ".join(f"{name} {v:.1f}" for name, v in rows[m].items() if name not in sweep and isinstance(v, float))
        print(f"{role:12s} m={m}: {line}  best triton {best} {triton.get(best, float('nan')):.1f} us "
              f"({n * k * 2 / triton[best] / 1e3:.0f} GB/s)" if best else f"{role} m={m}: {line}", flush=True)
        if m == 1:
            for kind, keep in (("tile", lambda label: not sweep[label].row), ("row", lambda label: sweep[label].row)):
                some = {k_: v for k_, v in triton.items() if keep(k_)}
                if some:
                    top = sorted(some, key=some.get)[:3]
                    print(f"{role:12s} m=1 best {kind} kernels: " + ", ".join(
                        f"{t} {some[t]:.1f} us ({n * k * 2 / some[t] / 1e3:.0f} GB/s)" for t in top), flush=True)
        if best is not None and m == 1:
            rows[m]["profiler_best_us"], kernels = gd.kernel_time_us(lambda f=fns[best], w=ws[0]: f(w))
            rows[m]["profiler_best_kernels"] = list(kernels)
        if m == 1:
            rows[m]["profiler_cublas_us"], kernels = gd.kernel_time_us(lambda f=fns["cublas"], w=ws[0]: f(w))
            rows[m]["profiler_cublas_kernels"] = list(kernels)
    return {"shape": [n, k], "copies": copies, "us": rows, "choice": choose(rows, sweep)}


def choose(rows: dict[int, dict[str, Any]], labels: Any, baseline: str = "cublas", fallback: str = "cublas") -> dict[str, Any]:
    """The Triton setting among `labels` with the least total time over BATCHES, chosen when it takes
    under MARGIN of the `baseline` row's total (else `fallback`)."""
    base = sum(rows[m][baseline] for m in BATCHES if isinstance(rows[m][baseline], float))
    totals = {label: sum(rows[m][label] for m in BATCHES) for label in labels
              if all(isinstance(rows[m].get(label), float) for m in BATCHES)}
    if not totals:
        return {"setting": fallback, f"{baseline}_total_us": base}
    best = min(totals, key=totals.get)
    return {"setting": best if not base or totals[best] < MARGIN * base else fallback, "best_triton": best,
            "triton_total_us": totals[best], f"{baseline}_total_us": base, "ratio": totals[best] / base if base else None}


def gemv_phase(p: gd.Preset, results: dict[str, Any]) -> str:
    """Fill results["gemv"]; return the RXF_GEMV value the figures favour."""
    roles: dict[str, Any] = {}
    for role, (n, k) in shapes(p).items():
        roles[role] = _role(role, n, k)
        torch.cuda.empty_cache()  # that role's weight copies
    out: dict[str, Any] = dict(roles)
    for which in ("cublas", "chosen"):
        total = sum(res["us"][1][res["choice"]["setting"] if which == "chosen" else "cublas"]
                    * (p.layers if role != "lm_head" else 1) for role, res in roles.items())
        out[f"step_us_{which}"] = total
        print(f"projections of one batch-1 step, {which}: {total / 1e3:.3f} ms", flush=True)
    env = ",".join(f"{role}={res['choice']['setting']}" for role, res in roles.items())
    out["suggested_RXF_GEMV"] = env
    print(f"suggested: RXF_GEMV={env}", flush=True)
    # Every role on its best Triton setting: under PDL (rxf/core/runner/pdl.py) a Triton projection
    # starts streaming while the kernel before it runs, which these standalone timings cannot show.
    all_triton = ",".join(f"{role}={res['choice'].get('best_triton', 'cublas')}" for role, res in roles.items())
    out["all_triton_RXF_GEMV"] = all_triton
    print(f"all triton: RXF_GEMV={all_triton}", flush=True)
    results["gemv"] = out
    return env
