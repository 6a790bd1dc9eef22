"""The quantized decode projections at batch 1-8, for `gpu_profile.py --phases qgemv`: per projection of
the preset and weight format, the method's current path vs the weight-only GEMV (`rxf.plugins.
quantization.qgemv`) over a small sweep of its settings, with bf16 cuBLAS on the same shape beside
them. It ends with the `RXF_QGEMV` value the figures favour. `QGEMV_FORMATS=int4,...` narrows the
formats (default all); `QGEMV_TOP=N` times the N fastest settings at one row at 2-16 rows too (default 2;
0: batch 1 only, and then the suggested value says `off` everywhere, its choice weighing every batch);
`QGEMV_TILES=1` adds a grid of tile settings (stages, split) timed at every row count.

Formats and what the method runs without the GEMV:
  fp8        FP8 with row scales (online, compressed-tensors): per-token activation quantization,
             then torch._scaled_mm
  fp8-block  FP8 with 128 x 128 block scales: per-token-group activation quantization, then the
             block-scaled Triton GEMM
  int4       AWQ / GPTQ int4 in groups of 128: `int4_linear` (split-K float32 atomics, memset, cast)

Peers among the settings: for int4, torch's own int4 GEMM (`int4_peers.py`, settings `torch2` /
`torch4` / `torch8`); for the FP8 formats, the `x`
settings (x quantized to E4M3 per tile, FP8 x FP8 dots on the tensor cores; checked against the
exact product with the looser bound of the methods' FP8 GEMMs). A candidate over its bound is timed
all the same and shown as "error E (T us)", never chosen.

Times are GPU time per call as a decode graph pays it (`gpu_gemv.graph_us`): one call per rotating
weight copy (>= 512 MB in flight, so L2 holds none), captured in one CUDA graph and replayed. TB/s:
the bytes the GEMV reads from its weight tensors (codes, scales, zeros) over its time. Every
candidate's output is checked against F.linear in float32 on the dequantized weight first (the
current FP8 paths also quantize activations: they get a looser bound).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import gpu_decode as gd
import gpu_gemv
import torch
import torch.nn.functional as F

# The dense sweep's batches and the GEMV tile's full 16 rows (int4 serves up to 16: `qgemv._MOST_ROWS`).
BATCHES = (*gpu_gemv.BATCHES, 16)
TOP = int(os.environ.get("QGEMV_TOP", "2"))  # settings (the fastest at batch 1) timed at every batch
# QGEMV_TILES=1: a grid of tile settings, every one timed at 2-16 rows too (the row kernel serves 1 row).
TILES = os.environ.get("QGEMV_TILES", "0") == "1"
DEVICE = torch.device("cuda")
GROUP = 128  # the int4 group and the FP8 scale block


def _sweep(fmt: str) -> list[tuple[Any, int]]:
    """(settings, split factor): the format's default and a few neighbours, each with the split
    chosen per shape (split_k 0), and the default tile with twice that split. Each is a Triton
    compile per role, so the list stays short (the phase runs in about a minute)."""
    from rxf.plugins.quantization.qgemv import DEFAULTS, PEERS, QuantSettings

    base = DEFAULTS[fmt]
    tiles = {"fp8": [(32, 256, 4, 4)], "fp8-block": [(32, 128, 6, 4)],
             "int4": [(64, 128, 4, 4), (256, 128, 3, 8)]}[fmt]
    others = [dataclasses.replace(base, block_n=n, block_k=k, num_stages=st, num_warps=w) for n, k, st, w in tiles]
    # The row kernel (batch 1; `qgemv_row_kernel`): small tiles in registers, more warps.
    # Word-wise dequantization (since 2026-12-05) favours more rows per thread: x is read once per word
    # column a thread holds and reused over its rows (`sass_count.py`: fp8 3.5 instructions a weight
    # at 32-64 x 256, 5.7 at 16 x 256 with 8 warps; int4 4.6 at 128 x 128, 6.0 at 32 x 128; int4 in
    # half2 arithmetic, `RXF_INT4_PAIRS`, 3.2 at 128 x 128 with 4 warps, 3.0 at 256 x 128 or 2 warps, 2.9
    # with 1; on the H200, 2026-12-06, 2 warps won at qkv, o_proj and down).
    # (block_n, block_k, warps, tiles read ahead: the label's st)
    # FP8 also takes many-row tiles (2 warps, or 128 rows over 4): a thread reuses x's words over more
    # rows (block-wise 64 x 128: 3.8 instructions a weight at 2 warps against 4.25 at 4), though at
    # 2-warp labels Llama-3-8B decoded slower end to end on an H100 (benchmarks/RESULTS.md, 2026-12-06).
    rows = {"fp8": [(16, 256, 8, 1), (32, 256, 4, 1), (64, 256, 4, 1), (64, 256, 8, 1), (32, 512, 8, 1),
                    (32, 256, 4, 2), (64, 256, 4, 2), (64, 256, 2, 1), (128, 256, 4, 1)],
            "fp8-block": [(32, 128, 4, 1), (64, 128, 4, 1), (64, 128, 8, 1), (64, 128, 4, 2), (64, 128, 2, 1),
                          (128, 128, 4, 1), (128, 128, 2, 1)],
            "int4": [(32, 128, 4, 1), (64, 128, 4, 1), (128, 128, 4, 1), (128, 128, 8, 1), (256, 128, 4, 1),
                     (128, 128, 2, 1), (128, 128, 4, 2), (64, 128, 2, 1), (128, 128, 1, 1)]}[fmt]
    row_settings = [dataclasses.replace(base, block_n=n, block_k=k, num_stages=st, num_warps=w, row=True)
                    for n, k, w, st in rows]
    # FP8 x FP8 on the tensor cores (label prefix x): tiles of 16-32 KB a stage, block_k capped at 128
    # by the block format's scales.
    fp8_x = {"fp8": [(64, 256, 4, 4), (128, 256, 3, 8), (64, 128, 6, 4), (128, 128, 4, 4)],
             "fp8-block": [(64, 128, 4, 4), (128, 128, 4, 4), (64, 128, 8, 4), (128, 128, 6, 8)], "int4": []}[fmt]
    x_settings = [dataclasses.replace(base, block_n=n, block_k=k, num_stages=st, num_warps=w) for n, k, st, w in fp8_x]
    plain = [(base, 1), *((s, 1) for s in others), (base, 2), *((s, 1) for s in row_settings),
             *((s, 2) for s in row_settings)]
    # int4: the library peer (torch's int4 GEMM at its three inner k tile counts).
    peers = [QuantSettings(base, peer=name) for name in PEERS] if fmt == "int4" else []
    if TILES:  # the tile kernel's grid for 2-16 rows: stages, split x1 / x2 / x4 (each a compile per role)
        grid = [dataclasses.replace(base, num_stages=st) for st in (1, 2, 4)]
        plain += [(s, f) for s in grid for f in (1, 2, 4) if (s, f) not in plain]
    return ([(QuantSettings(s), f) for s, f in plain] + [(QuantSettings(s, True), f) for s in x_settings for f in (1, 2)]
            + [(s, 1) for s in peers])


def _copy(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[SimpleNamespace, torch.Tensor]:
    """One weight in `fmt` as the method's layer holds it, and its dense float32 weight."""
    from rxf.plugins.quantization import fp8_ops
    from rxf.plugins.quantization.int4 import Int4Weights, pack_int32

    if fmt == "int4":
        codes = torch.randint(0, 16, (k, n), device=DEVICE, dtype=torch.uint8, generator=gen)
        zeros = torch.randint(0, 16, (k // GROUP, n), device=DEVICE, generator=gen).float()
        scales = (torch.rand(k // GROUP, n, device=DEVICE, generator=gen) * 2e-3 + 1e-4).bfloat16()
        dense = Int4Weights(codes, zeros, scales, torch.arange(k, device=DEVICE) // GROUP).dequantize(torch.float32)
        return SimpleNamespace(weight=pack_int32(codes, 0), scales=scales, zeros=zeros.bfloat16()), dense
    q, rows = fp8_ops.quantize_rows(torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5)
    if fmt == "fp8":
        return SimpleNamespace(weight=q, scales=rows, zeros=None), fp8_ops.dequantize_rows(q, rows, torch.float32)
    blocks = (torch.rand(n // GROUP, k // GROUP, device=DEVICE, generator=gen) + 0.5) * rows.mean()
    per_row = blocks.repeat_interleave(GROUP, dim=0).contiguous()  # as the layer holds them
    dense = fp8_ops.dequantize_blocks(q, per_row, GROUP, torch.float32)
    return SimpleNamespace(weight=q, scales=blocks.contiguous(), row_scales=per_row, zeros=None), dense


def _current(fmt: str, x: torch.Tensor) -> Callable[[SimpleNamespace], torch.Tensor]:
    from rxf.plugins.quantization import fp8_ops
    from rxf.plugins.quantization.int4_kernel import int4_linear

    if fmt == "fp8":
        return lambda c: fp8_ops.scaled_mm_rows(x, c.weight, c.scales, None, None)
    if fmt == "fp8-block":
        return lambda c: fp8_ops.block_fp8_linear(x, c.weight, c.row_scales, GROUP, None)
    return lambda c: int4_linear(x, c.weight, c.scales, c.zeros, GROUP, None)


def _resolve(fmt: str, settings: Any, factor: int, c: SimpleNamespace) -> Any:
    """The QuantGemv of `settings` over copy `c`, its chosen split times `factor` (or torch's int4 GEMM)."""
    from rxf.plugins.quantization import int4_peers
    from rxf.plugins.quantization.qgemv import QuantGemv

    if settings.peer:
        op = int4_peers.build(settings.peer, SimpleNamespace(qweight=c.weight, scales=c.scales, zeros=c.zeros), GROUP)
        if op is None:
            raise ValueError(f"{settings.peer} does not take this shape")
        return op

    kw = {"scale_k": c.weight.shape[1]} if fmt == "fp8" else {"scale_k": GROUP, "scale_rows": GROUP if fmt == "fp8-block" else 1}
    op = QuantGemv(fmt, settings, c.weight, c.scales, c.zeros, **kw)
    if factor == 1:
        return op
    tiles = dataclasses.replace(op.settings, split_k=factor * op.settings.split_k)
    return QuantGemv(fmt, dataclasses.replace(settings, tiles=tiles), c.weight, c.scales, c.zeros, **kw)


def _timed(fn: Callable[[Any], torch.Tensor], copies: list[Any], ref: torch.Tensor, bound: float,
           errors: dict[str, float] | None = None, label: str = "") -> float | str:
    """GPU time of fn per call, or why not; `errors[label]` gets its error (relative norm) if given."""
    try:
        err = ((fn(copies[0]).float() - ref).norm() / ref.norm()).item()
        if errors is not None:
            errors[label] = err
        us = gpu_gemv.graph_us(fn, copies)
        return round(us, 2) if err < bound else f"error {err:.2e} ({us:.1f} us)"
    except Exception as e:  # a setting Triton cannot compile here (e.g. shared memory)
        return f"failed: {type(e).__name__}: {e}"[:120]


def _role(fmt: str, role: str, n: int, k: int) -> dict[str, Any]:
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    first, dense = _copy(fmt, n, k, gen)
    nbytes = sum(t.nbytes for t in (first.weight, first.scales, first.zeros) if t is not None)
    copies = [first] + [SimpleNamespace(**{key: v.clone() if isinstance(v, torch.Tensor) else v
                                           for key, v in vars(first).items()})
                        for _ in range(max(2, min(32, (512 << 20) // nbytes)) - 1)]
    bf16 = [dense.bfloat16() for _ in range(max(2, min(8, (512 << 20) // (2 * n * k))))]
    ops = {}  # label -> one QuantGemv per copy (each its own counters)
    for settings, factor in _sweep(fmt):
        try:
            per_copy = [_resolve(fmt, settings, factor, c) for c in copies]
            ops[per_copy[0].label] = dict(zip(map(id, copies), per_copy, strict=True))
        except ValueError as e:
            print(f"{fmt} {role}: {settings.label}: {e}", flush=True)
    rows: dict[int, dict[str, Any]] = {}
    errors: dict[int, dict[str, float]] = {}  # rows of x -> label -> relative error against float32
    for m in BATCHES:
        x = torch.randn(m, k, device=DEVICE, generator=gen).bfloat16()
        ref = F.linear(x.float(), dense)
        row: dict[str, Any] = {
            "current": _timed(_current(fmt, x), copies, ref, 0.1 if fmt.startswith("fp8") else 1e-2),
            "bf16_cublas": _timed(lambda w, x=x: F.linear(x, w), bf16, ref, 1e-2),
        }
        if m == 1:
            labels = list(ops)
        else:
            timed = {label: v for label, v in rows[1].items() if label in ops and isinstance(v, float)}
            labels = sorted(timed, key=timed.get)[:TOP]
            labels += [label for label in timed if TILES and not label.startswith("r") and label not in labels]
        for label in labels:
            row[label] = _timed(lambda c, x=x, o=ops[label]: o[id(c)](x, None), copies, ref,
                                0.1 if label.startswith("x") else 1e-2, errors.setdefault(m, {}), label)
        rows[m] = row
        gemv = {label: v for label, v in row.items() if label in ops and isinstance(v, float)}
        best = min(gemv, key=gemv.get) if gemv else None
        cells = "  ".join(f"{name} {v:.1f}" if isinstance(v, float) else f"{name} {v}" for name, v in row.items()
                          if name not in ops)
        xs = {label: v for label, v in row.items() if label.startswith("x") and isinstance(v, float)}
        if xs:
            cells += f"  best fp8-x {min(xs, key=xs.get)} {min(xs.values()):.1f}"
        if best is None:
            print(f"{fmt:9s} {role:12s} m={m}: {cells}  no GEMV setting ran", flush=True)
            continue
        us = gemv[best]
        vs = "  ".join(f"{row[name] / us:.2f}x {name}" for name in ("current", "bf16_cublas") if isinstance(row[name], float))
        err = errors.get(m, {}).get(best, float("nan"))
        print(f"{fmt:9s} {role:12s} m={m}: {cells}  best {best} {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s, error "
              f"{err:.1e})  {vs}",
              flush=True)
    # Kernel by kernel at batch 1 (torch.profiler): where the current path's time goes.
    x1, c = torch.randn(1, k, device=DEVICE, generator=gen).bfloat16(), copies[0]
    current = _current(fmt, x1)
    rows[1]["profiler_current_us"], rows[1]["profiler_current_kernels"] = gd.kernel_time_us(lambda: current(c))
    gemv1 = {label: v for label, v in rows[1].items() if label in ops and isinstance(v, float)}
    if gemv1:
        op = ops[min(gemv1, key=gemv1.get)][id(c)]
        rows[1]["profiler_best_us"], rows[1]["profiler_best_kernels"] = gd.kernel_time_us(lambda: op(x1, None))
    return {"shape": [n, k], "bytes": nbytes, "copies": len(copies), "us": rows, "errors": errors,
            "choice": gpu_gemv.choose(rows, ops, "current", "off")}


def qgemv_phase(p: gd.Preset, results: dict[str, Any]) -> str:
    """Fill results["qgemv"]; return the RXF_QGEMV value the figures favour."""
    from rxf.plugins.quantization.qgemv import FORMATS, ROLES

    shapes = {role: nk for role, nk in gpu_gemv.shapes(p).items() if role in ROLES}
    out: dict[str, Any] = {}
    formats = [f for f in os.environ.get("QGEMV_FORMATS", ",".join(FORMATS)).split(",") if f in FORMATS]
    for fmt in formats:
        for role, (n, k) in shapes.items():
            out[f"{fmt}:{role}"] = _role(fmt, role, n, k)
            torch.cuda.empty_cache()  # that role's weight copies
    for fmt in formats:  # the batch-1 projections of one decode step, summed from the figures above
        res = {role: out[f"{fmt}:{role}"]["us"][1] for role in shapes}
        for name in ("current", "bf16_cublas", "chosen"):
            total = 0.0
            for role, row in res.items():
                setting = out[f"{fmt}:{role}"]["choice"]["setting"]
                key = name if name != "chosen" else ("current" if setting == "off" else setting)
                total += row[key] * p.layers if isinstance(row.get(key), float) else float("nan")
            out[f"step_us_{fmt}_{name}"] = total
        print(f"{fmt}: projections of one batch-1 step: bf16 cuBLAS {out[f'step_us_{fmt}_bf16_cublas'] / 1e3:.3f} ms, "
              f"current {out[f'step_us_{fmt}_current'] / 1e3:.3f} ms, chosen {out[f'step_us_{fmt}_chosen'] / 1e3:.3f} ms",
              flush=True)
    env = ",".join(f"{fmt}:{role}={out[f'{fmt}:{role}']['choice']['setting']}" for fmt in formats for role in shapes)
    out["suggested_RXF_QGEMV"] = env
    print(f"suggested: RXF_QGEMV={env}", flush=True)
    results["qgemv"] = out
    return env
