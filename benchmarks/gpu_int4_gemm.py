"""Int4 (AWQ / GPTQ) prefill and batched-decode GEMMs on the Llama-3-8B projections: where
`int4_kernel.int4_linear` should switch from its Triton GEMM to dequantize-then-cuBLAS
(`DEQUANT_ROWS`), against bf16 cuBLAS on the same shape.

Per projection (N, K) and row count M, GPU time per call (`gpu_gemv.graph_us`: CUDA graph replay, one
call per rotating weight copy, >= 256 MB of codes in flight) of:
  bf16      F.linear in bf16 (cuBLAS)
  gemm      the Triton int4 GEMM (`int4_linear` below DEQUANT_ROWS)
  dequant   `int4_dequantize` + torch.mm (`int4_linear` from DEQUANT_ROWS on)
  torch8    torch's int4 GEMM (`_weight_int4pack_mm`, inner k tiles 8), the library peer
Each output is checked against the float32 matmul of the dequantized weight first. The summary gives,
per M, the four projections' summed time as a ratio to bf16. JSON to $OUT/gpu_int4_gemm.json.

  python3 benchmarks/gpu_int4_gemm.py [--rows 16,32,64,128,256,512,1024,4096,16384]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import gpu_gemv
import torch
import torch.nn.functional as F
from gpu_fp8_gemm import SHAPES, report

from rxf.plugins.quantization.int4 import Int4Weights, pack_int32
from rxf.plugins.quantization.int4_kernel import int4_dequantize, int4_linear
from rxf.plugins.quantization.int4_peers import TorchInt4Gemv

DEVICE = torch.device("cuda")
GROUP = 128


def _copies(n: int, k: int) -> tuple[list[SimpleNamespace], torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    codes = torch.randint(0, 16, (k, n), device=DEVICE, dtype=torch.uint8, generator=gen)
    zeros = torch.randint(0, 16, (k // GROUP, n), device=DEVICE, generator=gen).float()
    scales = (torch.rand(k // GROUP, n, device=DEVICE, generator=gen) * 0.01).bfloat16()
    dense = Int4Weights(codes, zeros, scales, torch.arange(k, device=DEVICE) // GROUP).dequantize(torch.float32)
    q, z = pack_int32(codes, 0), zeros.bfloat16()
    count = max(2, min(16, (256 << 20) // (n * k // 2)))
    copies = [SimpleNamespace(q=q.clone(), s=scales.clone(), z=z.clone(), w=dense.bfloat16(),
                              peer=TorchInt4Gemv(codes, scales, z, GROUP, 8)) for _ in range(count)]
    return copies, dense


def _methods(x: torch.Tensor) -> dict:
    return {
        "bf16": lambda c: F.linear(x, c.w),
        "gemm": lambda c: int4_linear(x, c.q, c.s, c.z, GROUP, None, dequant_rows=1 << 30),
        "dequant": lambda c: torch.mm(x, int4_dequantize(c.q, c.s, c.z, GROUP, x.dtype)),
        "torch8": lambda c: c.peer(x, None),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,32,64,128,256,512,1024,4096,16384")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, dict[str, dict[str, float | str]]] = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    names = list(_methods(torch.empty(0)))
    print(f"{'projection':>13} {'M':>6} " + " ".join(f"{name:>18}" for name in names))
    for role, (n, k) in SHAPES.items():
        copies, dense = _copies(n, k)
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = x.float() @ dense.t()
            row: dict[str, float | str] = {}
            for name, fn in _methods(x).items():
                err = ((fn(copies[0]).float() - ref).norm() / ref.norm()).item()
                row[name] = gpu_gemv.graph_us(fn, copies) if err < 1e-2 else f"error {err:.1e}"
            results.setdefault(role, {})[str(m)] = row
            flops = 2 * m * n * k
            print(f"{role:>13} {m:>6} " + " ".join(
                f"{row[name]:9.1f}us {flops / row[name] / 1e6:5.0f}T" if isinstance(row[name], float)
                else f"{row[name]:>18}" for name in names), flush=True)
        del copies, dense
        torch.cuda.empty_cache()
    report(results, rows, names, "gpu_int4_gemm.json")


if __name__ == "__main__":
    main()
