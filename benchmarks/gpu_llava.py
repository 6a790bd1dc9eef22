"""Image-request throughput of a LLaVA-OneVision-shaped random model, with and without cache hits.

    python benchmarks/gpu_llava.py [--lm-layers 8] [--requests 32] [--image-size 384] [--backend triton] [--tiny]

One call on the GPU machine, no downloads: a random bf16 checkpoint with SigLIP-so400m vision shapes
(26 layers, hidden 1152, 384 px, patch 14 -> 729 tokens per tile) and Qwen2-7B text shapes (hidden
3584, 28 heads / 4 KV heads, vocab 152064) but only `--lm-layers` decoder layers (default 8 of 28, to
keep writing and loading the checkpoint within the time limit) is written with transformers'
`save_pretrained` and served by `Runtime` (scheduler process, TokenizerManager preprocessing).
Three passes over the same N distinct images, each request = chat prompt + 1 image -> 16 new tokens:
  cold         nothing cached: vision tower + full prefill for every request
  radix hit    same requests again: the image's pad ids hit the radix cache (no vision, no prefill
               of the cached prefix)
  feature hit  after `flush_cache` (KV gone): vision features come from the feature cache, the
               language model prefills again
`--tiny` runs the same on CPU with a tiny checkpoint (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rxf.entrypoints.runtime import Runtime
from rxf.plugins.multimodal.tiny import make_llava_checkpoint

SIGLIP_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26,
                 "num_attention_heads": 16, "image_size": 384, "patch_size": 14}
QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
            "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1e6, "initializer_range": 0.02}
PROMPT = "<|im_start|>user\n<image>\nDescribe the image in detail.<|im_end|>\n<|im_start|>assistant\n"


def png(size: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def build(path: Path, args: argparse.Namespace) -> Path:
    if args.tiny:
        return make_llava_checkpoint(path, "llava_onevision")
    side = SIGLIP_SO400M["image_size"]
    pinpoints = [[side * i, side * j] for i in range(1, 7) for j in range(1, 7)]  # OneVision's grid
    return make_llava_checkpoint(path, "llava_onevision", dtype=torch.bfloat16, device="cuda",
                                 text={**QWEN2_7B, "num_hidden_layers": args.lm_layers},
                                 vision=SIGLIP_SO400M, pinpoints=pinpoints)


async def run_pass(rt: Runtime, images: list[bytes], max_new: int) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    results = await asyncio.gather(*[rt.async_generate(PROMPT, params, image_data=[img]) for img in images])
    wall = time.perf_counter() - start
    metas = [r["meta_info"] for r in results]
    return {
        "requests": len(images),
        "wall_s": wall,
        "req_per_s": len(images) / wall,
        "prompt_tokens": sum(m["prompt_tokens"] for m in metas) / len(metas),
        "cached_tokens": sum(m["cached_tokens"] for m in metas) / len(metas),
        "prompt_tok_per_s": sum(m["prompt_tokens"] for m in metas) / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-layers", type=int, default=8, help="Qwen2-7B decoder layers kept (of 28)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=384, help="square images; 384 -> 2 anyres tiles")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--backend", default="triton",
                    help="attention backend (default triton: flashinfer's first-use JIT can take minutes)")
    ap.add_argument("--tiny", action="store_true", help="tiny checkpoint on CPU (script smoke test)")
    args = ap.parse_args()
    if args.tiny:
        args.image_size = min(args.image_size, 56)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --tiny on CPU")
    with tempfile.TemporaryDirectory(prefix="rxf-llava-") as tmp:
        t0 = time.perf_counter()
        path = build(Path(tmp), args)
        build_s = time.perf_counter() - t0
        gc.collect()  # the transformers model that wrote the checkpoint (its GPU memory back)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        overrides = {"model.path": str(path), "scheduler.max_running_requests": max(args.requests, 8),
                     "multimodal.feature_cache_mb": 4096}
        if args.tiny:
            overrides |= {"runtime.device": "cpu", "cache.max_total_tokens": 16384}
        else:
            overrides |= {"model.context_length": 8192, "attention.backend": args.backend}
        t0 = time.perf_counter()
        rt = Runtime.from_config(None, **overrides)
        load_s = time.perf_counter() - t0
        try:
            images = [png(args.image_size, seed=i) for i in range(args.requests)]
            asyncio.run(run_pass(rt, [png(args.image_size, seed=10**6)], args.max_new_tokens))  # warm-up
            rows = {"cold": asyncio.run(run_pass(rt, images, args.max_new_tokens))}
            rows["radix hit"] = asyncio.run(run_pass(rt, images, args.max_new_tokens))
            ok, message = rt.flush_cache()
            assert ok, message
            rows["feature hit"] = asyncio.run(run_pass(rt, images, args.max_new_tokens))
        finally:
            rt.shutdown()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = "tiny" if args.tiny else f"SigLIP-so400m + Qwen2-7B shapes, {args.lm_layers}/28 LM layers, bf16"
    print(f"\nLLaVA-OneVision-shaped random model ({shape}) on {device}")
    print(f"checkpoint build {build_s:.1f} s, engine load {load_s:.1f} s; {args.requests} requests, "
          f"{args.image_size}x{args.image_size} image each, {args.max_new_tokens} new tokens")
    print(f"{'pass':<12} {'req/s':>8} {'prompt tok/s':>13} {'prompt tok':>11} {'cached tok':>11} {'wall s':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['req_per_s']:>8.2f} {r['prompt_tok_per_s']:>13.0f} {r['prompt_tokens']:>11.0f} "
              f"{r['cached_tokens']:>11.0f} {r['wall_s']:>8.2f}")
    cold = rows["cold"]["req_per_s"]
    print(f"speed-up vs cold: radix hit x{rows['radix hit']['req_per_s'] / cold:.2f}, "
          f"feature hit x{rows['feature hit']['req_per_s'] / cold:.2f}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_llava.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
