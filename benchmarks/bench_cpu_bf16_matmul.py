"""bf16 matmuls on this CPU: torch's `F.linear` against `cpu_packing.upcast_linear` (float32, the weight
cast per call) and against a float32 weight kept, per row count; and the MoE torch path
(`experts_native`) with and without the upcast. What `cpu_packing.UPCAST_MIN_ROWS` was chosen from on a
CPU where oneDNN has no bf16 kernels (AVX2 alone); on one that has them F.linear is oneDNN's.

    python benchmarks/bench_cpu_bf16_matmul.py [--threads 2] [--rows 1,2,4,8,16,64,256,1024,4096]

Each figure: ms per call, the mean over 0.3 s of calls after 3 warm-up calls; shapes are the demo's
(SmolLM2-135M: 576 hidden, 1536 MLP, 960 qkv, 49152 vocabulary).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rxf.plugins.models.layers.moe import experts_native
from rxf.plugins.quantization import cpu_packing

SHAPES = [(1536, 576), (576, 1536), (960, 576), (49152, 576)]  # (outputs, inputs)


def ms(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.3:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def linear_ms(x: torch.Tensor, w: torch.Tensor, w32: torch.Tensor) -> tuple[float, float, float]:
    """bf16 F.linear, upcast_linear, and F.linear over the float32 weight `w32`."""
    return (ms(lambda: F.linear(x, w)), ms(lambda: cpu_packing.upcast_linear(x, w, None)),
            ms(lambda: F.linear(x.float(), w32).bfloat16()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256,1024,4096")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16: "
          f"{cpu_packing.onednn_bf16()}, {args.threads} threads; ms per call")
    gen = torch.Generator().manual_seed(0)
    print("| outputs x inputs | rows | bf16 F.linear | upcast_linear | float32 weight kept |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        w32 = w.float()
        for rows in map(int, args.rows.split(",")):
            if n * rows > 49152 * 1024:  # the head past a prefill's last rows: minutes of emulated bf16
                continue
            times = linear_ms(torch.randn(rows, k, generator=gen).bfloat16(), w, w32)
            print(f"| {n} x {k} | {rows} | " + " | ".join(f"{t:.3f}" for t in times) + " |")
    # MoE: 512 tokens, top 2 of 8 experts (~128 rows an expert), hidden 576, expert MLP 768.
    x = torch.randn(512, 576, generator=gen).bfloat16()
    w13 = (torch.randn(8, 2 * 768, 576, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(8, 576, 768, generator=gen) * 0.05).bfloat16()
    weights, ids = torch.randn(512, 8, generator=gen).softmax(-1).topk(2, -1)
    upcast = ms(lambda: experts_native(x, w13, w2, weights, ids))
    emulated = cpu_packing.emulated_bf16
    cpu_packing.emulated_bf16 = lambda w: False
    try:
        plain = ms(lambda: experts_native(x, w13, w2, weights, ids))
    finally:
        cpu_packing.emulated_bf16 = emulated
    print(f"experts_native, 512 tokens, top 2 of 8 experts: as served {upcast:.1f} ms, all F.linear {plain:.1f} ms "
          f"(the same where oneDNN has bf16 kernels)")


if __name__ == "__main__":
    main()
