"""Where a Qwen3-30B-A3B decode layer's routing launch spends its time at batch 1, and a MoE block's
launches together.

    python benchmarks/gpu_route_parts.py [--layers 4] [--reps 20]

Every figure is GPU time per launch (or per layer) of a chain captured in one CUDA graph and replayed
(`gpu_gemv.graph_us`), with PDL as `RXF_PDL` says (on by default on Hopper):
- parts of the routing, each a chain of 64 calls over distinct inputs: `norm_route` (the residual add,
  the norm, the 128 x 2048 router and the top 8 in one launch: what a layer runs; `norm_route_eEwW`:
  at E experts a program and W warps), `route` (no norm),
  `route_e8` (8 experts: the hand-off and the loads with next to no dot or ranking),
  `topk_e128` / `topk_e8` (one program's softmax and ranking of 128 / 8 logits, no projection);
  `benchmarks/gpu_hops.py` gives the bare hand-off beside them;
- layers: `--layers` MoE blocks of distinct random weights (routing, then the experts' two launches,
  each layer's output the next one's input), and the experts alone.
Prints a table and writes $OUT/gpu_route_parts.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from gpu_gemv import graph_us

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B


def routing_parts(reps: int) -> dict[str, float]:
    from rxf.plugins.models.layers.routing_kernel import norm_route_cuda, route_cuda, softmax_topk_cuda

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    xs = [torch.randn(1, HIDDEN, device=dev, dtype=bf16) for _ in range(64)]
    res = torch.randn(1, HIDDEN, device=dev, dtype=bf16)
    norm_w = torch.rand(HIDDEN, device=dev, dtype=bf16) + 0.5
    w128 = torch.randn(EXPERTS, HIDDEN, device=dev, dtype=bf16) * HIDDEN**-0.5
    w8 = w128[:8].contiguous()
    logits128 = [torch.randn(1, EXPERTS, device=dev, dtype=bf16) for _ in range(64)]
    logits8 = [t[:, :8].contiguous() for t in logits128]
    shapes = {f"norm_route_e{e}w{w}": graph_us(
        lambda x, e=e, w=w: norm_route_cuda(x, res, norm_w, 1e-6, w128, None, TOP_K, True, experts_per_program=e,
                                            num_warps=w), xs, reps)
        for e, w in ((1, 1), (2, 1), (2, 2), (4, 2), (8, 4), (16, 4))}
    return shapes | {
        "norm_route": graph_us(lambda x: norm_route_cuda(x, res, norm_w, 1e-6, w128, None, TOP_K, True), xs, reps),
        "route": graph_us(lambda x: route_cuda(x, w128, None, TOP_K, True), xs, reps),
        "route_e8": graph_us(lambda x: route_cuda(x, w8, None, 2, True), xs, reps),
        "topk_e128": graph_us(lambda t: softmax_topk_cuda(t, TOP_K, True), logits128, reps),
        "topk_e8": graph_us(lambda t: softmax_topk_cuda(t, 2, True), logits8, reps),
    }


def layers_us(num_layers: int, reps: int) -> dict[str, float]:
    """Per layer: routing + experts, and the experts alone."""
    from rxf.plugins.models.layers import fused_moe_decode as fmd
    from rxf.plugins.models.layers.routing_kernel import norm_route_cuda

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(num_layers):  # ~1.2 GB a layer: the experts come from HBM, not L2
        w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=bf16, generator=gen) * HIDDEN**-0.5
        w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=bf16, generator=gen) * INTER**-0.5
        router = torch.randn(EXPERTS, HIDDEN, device=dev, dtype=bf16, generator=gen) * HIDDEN**-0.5
        layers.append((w13, w2, router, torch.rand(HIDDEN, device=dev, dtype=bf16, generator=gen) + 0.5))
    state = {"h": torch.randn(1, HIDDEN, device=dev, dtype=bf16), "r": torch.randn(1, HIDDEN, device=dev, dtype=bf16)}
    fixed = [torch.topk(torch.rand(1, EXPERTS, device=dev, generator=gen), TOP_K) for _ in range(num_layers)]

    def moe_layer(i: int) -> None:
        w13, w2, router, norm_w = layers[i]
        weights, ids, x, r = norm_route_cuda(state["h"], state["r"], norm_w, 1e-6, router, None, TOP_K, True)
        state["h"], state["r"] = fmd.decode_experts(x, w13, w2, weights, ids), r

    def experts_only(i: int) -> None:
        w13, w2, _, _ = layers[i]
        vals, ids = fixed[i]
        state["h"] = fmd.decode_experts(state["h"], w13, w2, vals.softmax(-1), ids)

    return {"layer": graph_us(moe_layer, list(range(num_layers)), reps),
            "experts": graph_us(experts_only, list(range(num_layers)), reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "pdl": os.environ.get("RXF_PDL", "default")}
    results["routing_us"] = routing_parts(args.reps)
    results["layer_us"] = layers_us(args.layers, args.reps)
    print(f"{results['device']}, RXF_PDL={results['pdl']}: us per launch (routing) / per layer")
    for group in ("routing_us", "layer_us"):
        for name, us in results[group].items():
            print(f"{name:>16} {us:8.2f}")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_route_parts.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
