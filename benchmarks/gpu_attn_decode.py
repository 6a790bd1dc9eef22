"""Decode attention at small batch on the GPU: how the chunk merge and the split count set the kernel's time.

    RXF_PDL=1 python benchmarks/gpu_attn_decode.py [--batches 1] [--contexts 264,520,1032,4104]

For the Llama-3-8B head shape (32 query heads, 8 KV heads) and Qwen3-30B-A3B's (32 over 4), each batch and
context: rxf's triton decode kernel at the split count the backend picks and at 1, 2, 4, 8, 16 splits,
with the last program merging the chunks one by one (`loop`: `decode.MERGE_TILE_LIMIT` 0) or all at once
(`tile`: the limit 128, the default); then at the backend's split count with the tile merge, the chain
time without a store and with the launch storing the new K/V (`store`: plain, rotated, rotated with
Qwen3's head norms), as the backend runs it by default. Two times per setting, microseconds:
`kernel` (GPU time of one launch, torch.profiler) and `chain` (a CUDA graph of 32 launches replayed, per
launch: what a layer's attention costs between the kernels around it, launch latency and, under
RXF_PDL=1, the dependent launch's overlap included). Every output is checked against torch_native.
Figures go to $OUT/gpu_attn_decode.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode as gd  # noqa: E402
import gpu_gemv  # noqa: E402

MODES = {"loop": 0, "tile": 128}  # name: decode.MERGE_TILE_LIMIT


def chain_us(call: Any, launches: int = 32) -> float:
    """GPU time per launch of `call` captured `launches` times in one CUDA graph."""
    return gpu_gemv.graph_us(lambda _: call(), list(range(launches)), reps=20)


def store_variants_us(decode: Any, case: Any, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      splits: int) -> dict[str, float]:
    """Chain time per launch at the backend's split count (tile merge) without a store, with the new
    tokens' K/V stored by the launch (`decode.DecodeStore`, as the backend runs it by default), rotated,
    and rotated with Qwen3's head norms: what the launch's extra work costs at batch 1. Timing only:
    the tests check these outputs (the store makes them differ from the plain attention's)."""
    from rxf.core.attention import HeadNorm

    b, bs, hd = case.batch, q.shape[0], q.shape[-1]
    positions = b.seq_lens.long() - 1
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device="cuda", dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(int(positions.max()) + 1, device="cuda", dtype=torch.float32), inv_freq)
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)  # the fused kernels' cos | sin layout
    norm = HeadNorm(torch.ones(hd, device="cuda", dtype=q.dtype), torch.ones(hd, device="cuda", dtype=q.dtype), 1e-6)
    k, v = case.k.view(bs, -1, hd), case.v.view(bs, -1, hd)
    stores = {"none": None, "kv": decode.DecodeStore(k, v, b.out_cache_loc),
              "kv_rope": decode.DecodeStore(k, v, b.out_cache_loc, (positions, table)),
              "kv_rope_norm": decode.DecodeStore(k, v, b.out_cache_loc, (positions, table), norm)}
    nsplit = torch.full((bs,), splits, dtype=torch.int32, device="cuda")
    mid_o = torch.empty(bs, q.shape[1], splits, hd, device="cuda")
    mid_lse = torch.empty(bs, q.shape[1], splits, device="cuda")
    counters = torch.zeros(decode.counters_needed(bs, q.shape[1], k.shape[1]), dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    times = {}
    for name, store in stores.items():
        call = functools.partial(
            decode.decode_attention, q, k_buf, v_buf, out, b.req_to_token_pool.req_to_token, b.req_pool_indices,
            b.seq_lens, nsplit, splits, mid_o, mid_lse, counters, case.layer.scaling, store=store)
        call()
        times[name] = round(chain_us(call), 2)
    return times


def main() -> None:
    from rxf.core.forward import ForwardMode
    from rxf.core.registry import PluginRegistry
    from rxf.plugins.attention.triton import decode

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--contexts", default="264,520,1032,4104")
    args = ap.parse_args()
    registry = PluginRegistry.load()
    triton_cls, native_cls = registry.attention_backend("triton"), registry.attention_backend("torch_native")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "pdl": os.environ.get("RXF_PDL")}
    for shape in ("llama3-8b", "qwen3-30b-a3b"):
        p = gd.PRESETS[shape]
        for bs in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                case = gd.AttentionCase.make(p, ForwardMode.DECODE, bs, ctx - 1, 1)
                _, ref = case.forward(native_cls)
                backend, _ = case.forward(triton_cls)
                policy = int(backend._decode.num_kv_splits.max())
                k_buf, v_buf = case.ctx.token_to_kv_pool.get_kv_buffer(0)
                q = case.q.view(bs, p.heads, -1)
                b = case.batch
                row: dict[str, Any] = {"policy_splits": policy}
                for splits in sorted({1, 2, 4, 8, 16, policy}):
                    if ctx / splits < 16:
                        continue
                    nsplit = torch.full((bs,), splits, dtype=torch.int32, device="cuda")
                    mid_o = torch.empty(bs, p.heads, splits, q.shape[-1], device="cuda")
                    mid_lse = torch.empty(bs, p.heads, splits, device="cuda")
                    counters = torch.zeros(decode.counters_needed(bs, p.heads, p.kv_heads), dtype=torch.int32,
                                           device="cuda")
                    for mode, limit in MODES.items():
                        decode.MERGE_TILE_LIMIT = limit
                        for stages in (1, 2):
                            out = torch.empty_like(q)
                            call = functools.partial(
                                decode.decode_attention, q, k_buf, v_buf, out, b.req_to_token_pool.req_to_token,
                                b.req_pool_indices, b.seq_lens, nsplit, splits, mid_o, mid_lse, counters,
                                case.layer.scaling, num_stages=stages)
                            call()
                            err = ((out.float().view_as(ref) - ref.float()).norm() / ref.float().norm()).item()
                            key = f"s{splits} {mode} st{stages}"
                            if err > 2e-2:
                                row[key] = f"err {err:.3g}"
                                continue
                            kernel, _ = gd.kernel_time_us(call, iters=10)
                            row[key] = {"kernel": round(kernel, 2), "chain": round(chain_us(call), 2)}
                decode.MERGE_TILE_LIMIT = MODES["tile"]
                try:  # first GPU run pending: a failure here keeps the rows above
                    row["store"] = store_variants_us(decode, case, q, k_buf, v_buf, policy)
                except Exception as e:  # noqa: BLE001
                    row["store"] = f"failed: {type(e).__name__}: {e}"[:300]
                label = f"{shape} b{bs} ctx{ctx}"
                results[label] = row
                print(label, json.dumps(row), flush=True)
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_attn_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
