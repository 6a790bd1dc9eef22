"""What Gemma 3's bidirectional image attention costs: one attention layer of Gemma-3-4B's shape
(8 query heads, 4 kv heads, head_dim 256) over one prefill of `--tokens` tokens holding one image of
`--image` tokens in its middle, timing the backend's extend attention for the whole prefill against
`BidirectionalBlocks.attend` (the image rows recomputed over the KV pool), for a global layer and a
local one (window 1024).

    python benchmarks/bench_bidirectional_blocks.py                       # CPU, 1 thread, torch_native
    python benchmarks/bench_bidirectional_blocks.py --device cuda --backend triton --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from rxf.core.attention import AttentionContext
from rxf.core.forward import ForwardBatch, ForwardMode
from rxf.core.ipc.messages import MultimodalItem
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.core.registry import PluginRegistry
from rxf.plugins.models.layers.attention import RadixAttention
from rxf.plugins.models.layers.bidirectional_blocks import BidirectionalBlocks

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch_native")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--image", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device, dtype, n = torch.device(args.device), getattr(torch, args.dtype), args.tokens
    req = ReqToTokenPool(2, 2 * n, device)
    pool = TokenToKVPool(n + 8, 1, KV_HEADS, HEAD_DIM, dtype, device)
    row, slots = req.alloc(), pool.alloc(n)
    req.req_to_token[row, :n] = slots.to(device)
    ctx = AttentionContext(req, pool, HEADS, KV_HEADS, HEAD_DIM, dtype, device, 2, 2 * n)
    backend = PluginRegistry.load().attention_backend(args.backend)(ctx)
    item = MultimodalItem("image", 1, (n - args.image) // 2, args.image, bidirectional=True)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    batch = ForwardBatch(
        ForwardMode.PREFILL, 1, torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device),
        torch.tensor([row], device=device), lens, torch.zeros_like(lens), lens, slots.long().to(device),
        [n], [0], [n], torch.tensor([n - 1], device=device), req, pool, backend, mm_items=[[item]],
    )
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))

    def timed(f) -> float:
        f()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            f()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.repeats * 1e3

    backend.init_forward_metadata(batch)
    blocks = BidirectionalBlocks.of(batch)
    assert blocks is not None
    image_q = q.flatten(1)[blocks.rows]
    out = torch.empty(n, HEADS * HEAD_DIM, dtype=dtype, device=device)
    for window in (None, 1024):
        layer = RadixAttention(0, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, sliding_window=window)
        base = timed(lambda layer=layer: backend.forward(q, k, v, layer, batch))
        extra = timed(lambda layer=layer: blocks.attend(image_q, layer, batch, out))
        print(f"{args.backend} {args.dtype} window={window}: extend attention {base:.2f} ms, "
              f"image rows recomputed {extra:.2f} ms (+{100 * extra / base:.0f}%)")


if __name__ == "__main__":
    main()
