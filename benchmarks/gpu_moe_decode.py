"""Block sizes of the MoE decode kernels (`fused_moe_decode.py`: 1-4 tokens, two GEMV-shaped launches)
swept on this GPU, against the bytes they must read (issue 18):

    python benchmarks/gpu_moe_decode.py [--shape qwen3-30b-a3b|gpt-oss-20b] [--tokens 1,2,4] [--workers N]
    python benchmarks/gpu_moe_decode.py --tiny     # CPU, TRITON_INTERPRET=1, toy shapes: checks the script

Each kernel's (block_n, block_k, num_warps, num_stages) is swept with the other kernel at its default:
first the gate/up kernel's candidates, then the down kernel's with the best gate/up; the best pair is
then timed at every token count beside the defaults. Candidates are compiled first by spawned worker
processes (Triton's disk cache), then timed as `gpu_moe_tune.py` times: a CUDA graph of 8 calls, each
routed differently (so the experts come from HBM, not L2), replayed ~5 ms, median of 3, per call.
`floor_us` is the distinct experts' weight bytes of a call at the copy bandwidth measured here (read +
write of a 1 GiB copy, as gpu_decode.py's roofline), so `of_floor` is the share of the memory's rate
a call reaches. (Before 2026-12-05 the floor counted experts over all 8 routings and halved the
bandwidth: floors of that day's first run are off by both.) Writes $OUT/gpu_moe_decode.json; prints the winners and `blocks=` to paste into
`fused_moe_decode.py` last. Also times what runs between the attention block and the experts: the
residual add + norm + router projection + routing in one launch (`routing_kernel.norm_route_cuda`),
the norm then the fused router (`route_cuda`), and the norm, the projection (`F.linear`) and the
routing kernel apart.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_moe_tune import Problem, time_per_call  # noqa: E402  (the timing loop is the tuner's)

SHAPES = {
    "qwen3-30b-a3b": Problem(128, 2048, 768, 8, torch.bfloat16, "cuda"),
    "gpt-oss-20b": Problem(32, 2880, 2880, 4, torch.bfloat16, "cuda"),
}
TINY = Problem(8, 64, 32, 2, torch.float32, "cpu")
SMEM = 227 * 1024  # H100/H200 per-block limit


def candidates(kernel: str, item: int, tiny: bool) -> list[tuple[int, int, int, int, bool]]:
    """(block_n, block_k, num_warps, num_stages, ROW): the tile form within shared memory, then the
    ROW form (registers only: two weight tiles per projection and a float32 product tile per thread)."""
    if tiny:
        return [(16, 32, 4, 2, False), (32, 16, 4, 2, False), (16, 32, 4, 1, True)]
    out = []
    widths = (16, 32, 64) if kernel == "gate_up" else (16, 32, 64, 128)
    for bn, bk, warps, stages in itertools.product(widths, (64, 128, 256, 512), (4, 8), (2, 3, 4, 6)):
        tiles = (2 if kernel == "gate_up" else 1) * bn * bk + bk * 16  # weight tiles + the padded activation
        if tiles * item * stages <= SMEM:
            out.append((bn, bk, warps, stages, False))
    projections = 2 if kernel == "gate_up" else 1
    for bn, bk, warps in itertools.product((8, 16, 32), (128, 256, 512), (4, 8)):
        if projections * bn * bk <= 64 * 32 * warps * 2 and bn * bk >= 32 * warps * 8:  # <= 128 regs of tiles
            out.append((bn, bk, warps, 1, True))
    return out


def weights(p: Problem, zeros: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    make = torch.zeros if zeros else torch.randn
    w13 = make(p.experts, 2 * p.inter, p.hidden, device=p.device, dtype=p.dtype)
    w2 = make(p.experts, p.hidden, p.inter, device=p.device, dtype=p.dtype)
    return w13, w2


def inputs(p: Problem, m: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    """`count` (x, topk_weights, topk_ids) of m tokens, routed uniformly at random, each differently."""
    gen = torch.Generator(device=p.device).manual_seed(m)
    out = []
    for _ in range(count):
        x = torch.randn(m, p.hidden, device=p.device, generator=gen).to(p.dtype)
        ids = torch.stack([torch.randperm(p.experts, device=p.device, generator=gen)[: p.top_k] for _ in range(m)])
        w = torch.rand(m, p.top_k, device=p.device, generator=gen)
        out.append((x, w / w.sum(-1, keepdim=True), ids))
    return out


_WORKER: dict[str, Any] = {}


def _init(p: Problem) -> None:
    _WORKER.update(p=p, w=weights(p, zeros=True), x=inputs(p, 1, 1)[0])


def _compile(pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str | None]:
    from rxf.plugins.models.layers.fused_moe_decode import decode_experts

    (w13, w2), (x, w, ids) = _WORKER["w"], _WORKER["x"]
    errors = []
    for blocks in pairs:
        try:
            decode_experts(x, w13, w2, w, ids, blocks=blocks)
            errors.append(None)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:160])
    if x.is_cuda:
        torch.cuda.synchronize()
    return errors


def precompile(p: Problem, pairs: list[tuple[Any, Any]], workers: int) -> None:
    start = time.perf_counter()
    chunk = max(1, math.ceil(len(pairs) / (workers * 3)))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init, initargs=(p,)) as pool:
        list(pool.map(_compile, [pairs[i : i + chunk] for i in range(0, len(pairs), chunk)]))
    print(f"compiled {len(pairs)} variants with {workers} workers in {time.perf_counter() - start:.1f}s", flush=True)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * a.numel() * 10 / (begin.elapsed_time(end) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    from rxf.plugins.models.layers import fused_moe_decode as fmd

    p = TINY if args.tiny else SHAPES[args.shape]
    cuda = p.device == "cuda"
    item = torch.finfo(p.dtype).bits // 8
    tokens = [int(t) for t in args.tokens.split(",")]
    default = fmd.default_blocks((p.experts, p.inter, p.hidden))  # this shape's (SHAPE_BLOCKS)
    gate_up, down = candidates("gate_up", item, args.tiny), candidates("down", item, args.tiny)
    pairs = [(g, default[1]) for g in gate_up] + [(g, d) for g in gate_up[:1] for d in down]
    if cuda and args.workers:
        precompile(p, pairs, args.workers)  # the down sweep's gate/up may differ: its variants compile when timed
    w13, w2 = weights(p)
    sets = {m: inputs(p, m, 8 if cuda else 1) for m in tokens}
    bandwidth = copy_bandwidth() if cuda else math.nan
    per_expert = (3 * p.inter * p.hidden) * item

    def timed(blocks: tuple[Any, Any], m: int) -> float:
        try:
            return time_per_call(lambda s: fmd.decode_experts(s[0], w13, w2, s[1], s[2], blocks=blocks), sets[m], cuda)
        except Exception as e:  # out of resources at launch
            print(f"{blocks}: {type(e).__name__}: {e}"[:200], flush=True)
            return math.inf

    m0 = tokens[0]
    sweep_g = {g: timed((g, default[1]), m0) for g in gate_up}
    best_g = min(sweep_g, key=sweep_g.get)
    sweep_d = {d: timed((best_g, d), m0) for d in down}
    best = (best_g, min(sweep_d, key=sweep_d.get))
    results: dict[str, Any] = {"shape": args.shape if not args.tiny else "tiny", "copy_bandwidth_tb_s": bandwidth / 1e12,
                               "default": default, "best": best, "per_token_count": {}}
    print(f"{'tokens':>6} {'floor_us':>9} {'default_us':>11} {'best_us':>8} {'of_floor':>9}")
    for m in tokens:
        # distinct experts a call reads (mean over the routings); their bytes at the copy's rate (the
        # bytes read + written per second, as gpu_decode.py's roofline counts a read-only stream)
        distinct = sum(len(set(s[2].flatten().tolist())) for s in sets[m]) / len(sets[m])
        floor = distinct * per_expert / bandwidth * 1e6 if cuda else math.nan
        d_us, b_us = timed(default, m) * 1e6, timed(best, m) * 1e6
        results["per_token_count"][m] = {"floor_us": floor, "default_us": d_us, "best_us": b_us,
                                         "distinct_experts": distinct, "best_of_floor": floor / b_us}
        print(f"{m:>6} {floor:>9.1f} {d_us:>11.1f} {b_us:>8.1f} {floor / b_us:>9.2f}", flush=True)
    # What a decode layer runs between the attention block and the experts: the residual add + norm, the
    # router projection and the routing, as one launch (norm_route_cuda), as the norm then the fused
    # router (route_cuda), and as three (the norm, the projection on cuBLAS, the routing kernel).
    from rxf.plugins.models.layers.moe import select_experts
    from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm
    from rxf.plugins.models.layers.routing_kernel import norm_route_cuda, route_cuda

    router = torch.randn(p.experts, p.hidden, device=p.device, dtype=p.dtype) * p.hidden**-0.5
    norm_w = torch.ones(p.hidden, device=p.device, dtype=p.dtype)
    residuals = {m: torch.randn(m, p.hidden, device=p.device, dtype=p.dtype) for m in tokens}
    variants = {
        "one_launch": lambda s, r: norm_route_cuda(s[0], r, norm_w, 1e-6, router, None, p.top_k, True),
        "norm_then_fused_router": lambda s, r: route_cuda(rmsnorm(s[0], norm_w, 1e-6, r, out=torch.empty_like(s[0]),
                                                                  res_out=torch.empty_like(r)), router, None, p.top_k, True),
        "three_launches": lambda s, r: select_experts(torch.nn.functional.linear(
            rmsnorm(s[0], norm_w, 1e-6, r, out=torch.empty_like(s[0]), res_out=torch.empty_like(r)), router), p.top_k, True),
    }
    for m in tokens:
        times = {name: time_per_call(lambda s, f=f, r=residuals[m]: f(s, r), sets[m], cuda) * 1e6
                 for name, f in variants.items()}
        results["per_token_count"][m]["norm_and_routing_us"] = times
        print(f"norm + routing, {m} token(s): " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)
    # The one launch's shape at the fewest tokens: experts per program x warps.
    shapes = {}
    for per_program in (1, 2, 4, 8):
        for warps in (1, 2, 4):
            def call(s, e=per_program, w=warps, r=residuals[m0]):
                return norm_route_cuda(s[0], r, norm_w, 1e-6, router, None, p.top_k, True, experts_per_program=e,
                                       num_warps=w)
            try:
                shapes[f"e{per_program}w{warps}"] = time_per_call(call, sets[m0], cuda) * 1e6
            except Exception as e:  # noqa: BLE001 - a shape that does not compile (registers) is skipped
                shapes[f"e{per_program}w{warps}"] = f"failed: {type(e).__name__}"
    results["router_shapes_us"] = shapes
    print(f"norm + routing shapes, {m0} token(s): " + ", ".join(
        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in shapes.items()), flush=True)
    results["gate_up_sweep_us"] = {str(k): v * 1e6 for k, v in sorted(sweep_g.items(), key=lambda kv: kv[1])}
    results["down_sweep_us"] = {str(k): v * 1e6 for k, v in sorted(sweep_d.items(), key=lambda kv: kv[1])}
    for name, sweep in (("gate_up", sweep_g), ("down", sweep_d)):
        top = sorted(sweep.items(), key=lambda kv: kv[1])[:5]
        print(f"{name} top 5 at {m0} token(s): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in top))
    print(f"blocks={best}")
    print(f"{fmd.ENV}={fmd.label(best[0])},{fmd.label(best[1])}")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_moe_decode.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
