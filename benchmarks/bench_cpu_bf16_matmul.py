"""bf16 and int4 matmuls on this CPU: torch's `F.linear` against `cpu_packing.upcast_linear` (float32, the weight
cast per call) and against a float32 weight kept, per row count; and the MoE torch path
(`experts_native`) with and without the upcast. What `cpu_packing.UPCAST_MIN_ROWS` was chosen from on a
CPU where oneDNN has no bf16 kernels (AVX2 alone); on one that has them F.linear is oneDNN's.
`--int4` times torch's int4 op (`cpu_packing.int4_linear`, bf16 activations) against the float32
matmul by the weight dequantized per call (`dequantize_nibbles`, timed alone too), groups of 32:
what `cpu_packing.INT4_DEQUANT_MIN_ROWS` was chosen from. `--towers` times transformers' vision towers on one image in bf16 and in float32, random weights
(`cpu_packing.large_matmul_dtype`: what LLaVA / Gemma 3 build theirs in on such a CPU).

    python benchmarks/bench_cpu_bf16_matmul.py [--threads 2] [--rows 1,2,4,8,16,64,256,1024,4096]
                                               [--towers clip-l-336,siglip-so400m-384] [--int4] [--no-matmuls]

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


# Full-size towers: LLaVA-1.5's CLIP ViT-L/14 at 336 px (577 patches), LLaVA-OneVision's SigLIP
# so400m at 384 (729 patches).
TOWERS = {
    "clip-l-336": ("CLIPVisionConfig", {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                        "num_attention_heads": 16, "image_size": 336, "patch_size": 14}),
    "siglip-so400m-384": ("SiglipVisionConfig", {"hidden_size": 1152, "intermediate_size": 4304,
                                                 "num_hidden_layers": 27, "num_attention_heads": 16,
                                                 "image_size": 384, "patch_size": 14}),
}


def tower_seconds(name: str) -> tuple[float, float]:
    """One image through the tower, seconds: bf16, float32 (the second of two calls each)."""
    import transformers
    from transformers import AutoModel

    cls_name, kwargs = TOWERS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    tower = AutoModel.from_config(config, dtype=torch.float32).eval()
    pixels = torch.randn(1, 3, config.image_size, config.image_size)
    times = []
    for dtype in (torch.bfloat16, torch.float32):
        tower.to(dtype)
        with torch.inference_mode():
            tower(pixels.to(dtype))
            start = time.perf_counter()
            tower(pixels.to(dtype))
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def int4_table(row_counts: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    print("| outputs x inputs | rows | int4 op | dequantized, float32 | of which dequantizing |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        table = torch.stack([torch.rand(k // 32, n, generator=gen) * 0.01,
                             torch.randn(k // 32, n, generator=gen) * 0.01], dim=-1).bfloat16()
        packed, nibbles = cpu_packing.pack_codes(codes), cpu_packing.pack_nibbles(codes)

        def dequantized(x=None, nibbles=nibbles, table=table):
            w = cpu_packing.dequantize_nibbles(nibbles, table, 32)
            return w if x is None else cpu_packing.upcast_linear(x, w, None)

        dequantize = ms(dequantized)
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen)
            op = ms(lambda x=x, packed=packed, table=table: cpu_packing.int4_linear(x, packed, 32, table, None))
            upcast = ms(lambda x=x, fn=dequantized: fn(x))
            print(f"| {n} x {k} | {rows} | {op:.3f} | {upcast:.3f} | {dequantize:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256,1024,4096")
    ap.add_argument("--towers", default="", help="comma-separated: " + ", ".join(TOWERS))
    ap.add_argument("--int4", action="store_true", help="the int4 table")
    ap.add_argument("--no-matmuls", action="store_true", help="no bf16 matmul table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16: "
          f"{cpu_packing.onednn_bf16()}, {args.threads} threads")
    for name in filter(None, args.towers.split(",")):
        bf16, fp32 = tower_seconds(name)
        print(f"{name}, one image: bf16 {bf16:.2f} s, float32 {fp32:.2f} s ({bf16 / fp32:.1f}x)")
    row_counts = [int(r) for r in args.rows.split(",")]
    if args.int4:
        int4_table(row_counts)
    if not args.no_matmuls:
        matmuls(row_counts)


def matmuls(row_counts: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    print("ms per call")
    print("| outputs x inputs | rows | bf16 F.linear | upcast_linear | float32 weight kept |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        w32 = w.float()
        for rows in row_counts:
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
