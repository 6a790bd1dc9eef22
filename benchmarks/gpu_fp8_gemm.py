"""FP8 prefill and batched-decode GEMMs on the Llama-3-8B projections: which block-scaled GEMM
`fp8_ops.block_fp8_linear` should take, against bf16 cuBLAS on the same shape.

Per projection (N, K) and row count M, GPU time per call (`gpu_gemv.graph_us`: CUDA graph replay, one
call per rotating weight copy, >= 256 MB of weights in flight so L2 holds none at small M) of:
  bf16        F.linear in bf16 (cuBLAS)
  triton      per-token-group quantization + rxf's block-scaled Triton GEMM (128 x 128 blocks)
  cublas      the same quantization (column-major scales) + torch._scaled_mm with 1 x 128
              activation and 128 x 128 weight scales (cuBLAS block scaling, CUDA >= 12.9)
  cublas_rows the same with a 1 x 128 scale per weight row and block
  rowwise     per-token quantization + torch._scaled_mm with per-row weight scales (online FP8)
  flashinfer  the `cublas` quantization + FlashInfer's `fp8_blockscale_gemm_sm90` (TensorRT-LLM's
              port of DeepGEMM, 128 x 128 weight blocks; Hopper only): a peer. Its module comes
              built from the CPU box (fi_cache_build.py); it compiles a kernel per (N, K) and config
              with the machine's nvcc on first use (~1.4 s each; 39 cover Llama-3-8B's projections
              at 1-16k rows)
  quant       the 128-group activation quantization alone
Every GEMM's output is checked against the float32 matmul of the dequantized operands first. The
table gives microseconds and TFLOP/s; the summary, per M, the four projections' summed time as a
ratio to bf16. JSON to $OUT/gpu_fp8_gemm.json.

  python3 benchmarks/gpu_fp8_gemm.py [--rows 8,64,256,1024,4096,16384]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import gpu_gemv
import torch
import torch.nn.functional as F

from rxf.plugins.quantization import fp8_ops
from rxf.plugins.quantization.fp8_kernels import per_token_group_quant

DEVICE = torch.device("cuda")
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
BLOCK = 128


def _weights(n: int, k: int) -> list[dict[str, torch.Tensor | None]]:
    copies = max(1, -(-256 * 2**20 // (n * k)))  # FP8 bytes in flight >= 256 MB
    out = []
    for _ in range(copies):
        dense = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
        q, rows = fp8_ops.quantize_rows(dense)
        blocks = (torch.rand(n // BLOCK, k // BLOCK, device=DEVICE) + 0.5) * rows.mean()
        scale = blocks.repeat_interleave(BLOCK, 0)
        out.append({"dense": dense, "q": q, "rows": rows, "scale": scale, "blocks": blocks,
                    "cublas": _cublas_scale(q, scale, "cublas-blocks"),
                    "cublas_rows": _cublas_scale(q, scale, "cublas-rows")})
    return out


def _cublas_scale(q: torch.Tensor, scale: torch.Tensor, choice: str) -> fp8_ops.CublasScales | None:
    os.environ["RXF_FP8_BLOCK_GEMM"] = choice
    try:
        return fp8_ops.cublas_block_scales(q, scale, BLOCK, BLOCK)
    finally:
        del os.environ["RXF_FP8_BLOCK_GEMM"]


def _methods(x: torch.Tensor) -> dict[str, Callable[[dict], torch.Tensor]]:
    methods = {
        "bf16": lambda w: F.linear(x, w["dense"]),
        "triton": lambda w: fp8_ops.block_fp8_linear(x, w["q"], w["scale"], BLOCK, None),
        "cublas": lambda w: fp8_ops.block_fp8_linear(x, w["q"], w["scale"], BLOCK, None, w["cublas"]),
        "cublas_rows": lambda w: fp8_ops.block_fp8_linear(x, w["q"], w["scale"], BLOCK, None, w["cublas_rows"]),
        "rowwise": lambda w: fp8_ops.scaled_mm_rows(x, w["q"], w["rows"], None, None),
        "quant": lambda w: per_token_group_quant(x, BLOCK, pad_rows=4, column_major=True)[0],
        "flashinfer": lambda w: _flashinfer(x, w),
    }
    return methods


def _flashinfer(x: torch.Tensor, w: dict) -> torch.Tensor:
    """DeepGEMM reads the activation scales as `cublas` does ([K / 128, M rounded up to 4], rows
    contiguous) and the weight's per 128 x 128 block; the output rows past M are the padding's."""
    from flashinfer.gemm import fp8_blockscale_gemm_sm90

    xq, xs = per_token_group_quant(x, BLOCK, pad_rows=4, column_major=True)
    return fp8_blockscale_gemm_sm90(xq, w["q"], xs, w["blocks"])[: x.shape[0]]


def _check(name: str, out: torch.Tensor, x: torch.Tensor, w: dict) -> None:
    if name in ("bf16", "quant"):
        return
    if name == "rowwise":
        xq, xs = fp8_ops.quantize_per_token(x)
        ref = (xq.float() * xs) @ fp8_ops.dequantize_rows(w["q"], w["rows"], torch.float32).t()
    else:
        xq, xs = fp8_ops.quantize_per_token(x, BLOCK)
        ref = fp8_ops.dequantize_blocks(xq, xs, BLOCK, torch.float32) @ fp8_ops.dequantize_blocks(
            w["q"], w["scale"], BLOCK, torch.float32).t()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    if not rel < 1e-2:
        raise AssertionError(f"{name}: relative error {rel:.2e} against the dequantized matmul")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,64,256,1024,4096,16384")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, dict[str, dict[str, float | str]]] = {}  # a failed method: its error
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'projection':>13} {'M':>6} " + " ".join(f"{m:>18}" for m in _methods(torch.empty(0))))
    for role, (n, k) in SHAPES.items():
        ws = _weights(n, k)
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            row: dict[str, float | str] = {}
            for name, fn in _methods(x).items():
                if name.startswith("cublas") and ws[0][name] is None:
                    continue
                try:
                    start = time.perf_counter()
                    out = fn(ws[0])
                    torch.cuda.synchronize()
                    if time.perf_counter() - start > 0.5:  # a kernel compiled on first use (flashinfer)
                        print(f"{role} M={m} {name}: first call {time.perf_counter() - start:.1f} s", flush=True)
                    _check(name, out, x, ws[0])
                except Exception as e:  # noqa: BLE001 (a peer's failure is a table cell, not the run's end)
                    row[name] = f"{type(e).__name__}: {str(e)[:200]}"
                    print(f"{role} M={m} {name}: {row[name]}", flush=True)
                    continue
                row[name] = gpu_gemv.graph_us(fn, ws)  # one call per weight copy, in a graph
            results.setdefault(role, {})[str(m)] = row
            flops = 2 * m * n * k
            print(f"{role:>13} {m:>6} " + " ".join(
                f"{row[name]:9.1f}us {flops / row[name] / 1e6:5.0f}T" if isinstance(row.get(name), float) else f"{'-':>18}"
                for name in _methods(x)), flush=True)
    report(results, rows, list(_methods(torch.empty(0))), "gpu_fp8_gemm.json")


def report(results: dict, rows: list[int], names: list[str], file: str) -> None:
    """Per row count, each method's time summed over SHAPES as a ratio to bf16 (methods that failed at
    some projection are left out), then `results` as JSON to $OUT/file."""
    print("\nsum over the four projections, ratio to bf16 (above 1: faster than bf16)")
    for m in rows:
        cells = [results[r][str(m)] for r in SHAPES]
        total = {name: sum(c[name] for c in cells) for name in names
                 if all(isinstance(c.get(name), float) for c in cells)}
        print(f"M={m:>6}: " + ", ".join(f"{name} {total['bf16'] / t:.2f}x ({t:.0f} us)" for name, t in total.items()))
    out = Path(os.environ.get("OUT", "/tmp")) / file
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": results}, indent=1))


if __name__ == "__main__":
    main()
