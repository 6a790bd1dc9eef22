"""FP8 layer inputs on the Llama-3-8B shapes: the RMSNorm (or SiLU·mul) then the 1 x 128 activation
quantization cuBLAS's block-scaled GEMM reads, as two launches (the default) against one
(`RXF_FP8_FUSED_INPUT=1`: `rmsnorm_kernel.rmsnorm_fp8`, `per_token_group_quant(gated=True)`), with
each launch alone beside them. GPU time per call (`gpu_gemv.graph_us`: rotating input copies
captured in a CUDA graph), at prefill and batched-decode row counts; GB/s counts the bytes each
path must move at least. The fused and unfused codes are compared first (dequantized, relative).

  python3 benchmarks/gpu_fp8_inputs.py [--rows 256,4096,16384]
"""

from __future__ import annotations

import argparse

import gpu_gemv
import torch

from rxf.plugins.models.layers import RMSNorm, SiluAndMul
from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm_fp8
from rxf.plugins.quantization.fp8_kernels import per_token_group_quant

DEVICE = torch.device("cuda")
HIDDEN, INTER, GROUP = 4096, 14336, 128


def _quant(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return per_token_group_quant(x, GROUP, pad_rows=4, column_major=True, gated=gated)


def _copies(m: int, width: int) -> list[torch.Tensor]:
    n = max(2, -(-512 * 2**20 // (m * width * 2)))  # >= 512 MB of inputs in flight
    return [torch.randn(m, width, device=DEVICE, dtype=torch.bfloat16) for _ in range(min(n, 16))]


def _rel(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> float:
    def deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (q.float().view(q.shape[0], -1, GROUP) * s[:, :, None]).view(q.shape[0], -1)
    x, y = deq(*a), deq(*b)
    return ((x - y).norm() / y.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,4096,16384")
    args = ap.parse_args()
    norm = RMSNorm(HIDDEN, 1e-5, dtype=torch.bfloat16).to(DEVICE)
    norm.weight.normal_(1.0, 0.1)
    act = SiluAndMul()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for m in (int(r) for r in args.rows.split(",")):
        hs, res = _copies(m, HIDDEN), torch.randn(m, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        gs = _copies(m, 2 * INTER)
        # Checks first, on copies (the timed calls update the residual in place).
        r1, r2 = res.clone(), res.clone()
        fused = rmsnorm_fp8(hs[0].clone(), norm.weight, norm.eps, r1, GROUP, pad_rows=4, column_major=True)
        unfused = _quant(norm(hs[0].clone(), r2)[0])
        checks = {"norm": _rel(fused, unfused), "gated": _rel(_quant(gs[0], True), _quant(act(gs[0])))}
        paths = {
            "norm (flashinfer add+norm)": (lambda h, res=res: norm(h, res), hs, 3 * 2 * HIDDEN),
            "quant of a norm's output": (lambda h: _quant(h), hs, 2 * HIDDEN + HIDDEN),
            "norm then quant": (lambda h, res=res: _quant(norm(h, res)[0]), hs, 3 * 2 * HIDDEN + HIDDEN),
            "norm + quant, one launch": (
                lambda h, res=res: rmsnorm_fp8(h, norm.weight, norm.eps, res, GROUP, pad_rows=4, column_major=True),
                hs, 3 * 2 * HIDDEN + HIDDEN),
            "silu·mul (flashinfer)": (lambda g: act(g), gs, 2 * 2 * INTER + 2 * INTER),
            "quant of silu·mul's output": (lambda g: _quant(g[:, :INTER]), gs, 2 * INTER + INTER),
            "silu·mul then quant": (lambda g: _quant(act(g)), gs, 2 * 2 * INTER + INTER),
            "silu·mul + quant, one launch": (lambda g: _quant(g, True), gs, 2 * 2 * INTER + INTER),
        }
        print(f"\nM = {m}: fused vs unfused codes, relative: norm {checks['norm']:.1e}, gated {checks['gated']:.1e}")
        for name, (fn, xs, bytes_per_row) in paths.items():
            us = gpu_gemv.graph_us(fn, xs)
            print(f"  {name:<30} {us:9.1f} us  {m * bytes_per_row / us / 1e3:7.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
