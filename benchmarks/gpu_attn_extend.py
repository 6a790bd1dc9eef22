"""Extend (prefill) attention on the GPU: rxf's triton kernel per launch setting, an older tree's kernel and
FlashInfer's ragged prefill as peers, on the shapes an offline run's prefill steps take.

    python benchmarks/gpu_attn_extend.py [--base bench-prev] [--configs 64,64,4,2 128,64,8,3 ...]

Llama-3-8B's heads (32 query, 8 KV, head_dim 128), bf16. Settings are
BLOCK_M,BLOCK_N,num_warps,num_stages, prefixed `p` for the 4 query heads of a KV head packed into a
block's rows (`extend.PACK_GQA`). Cases: `chunk` (16 prompts of 1024 +- 50% new
tokens, no prefix: the offline phase's prefill chunk of ~16k tokens), `chunk-fp8` (the same over an FP8
e4m3 pool, whose new keys the kernel reads back from the pool), `long` (2 prompts of 8192), `prefix` (8
requests of 512 new tokens over 2048 cached). Per case and setting (`default`: `extend._config`'s
and `PACK_GQA`): GPU time of one launch (CUDA events over 20 launches after
3 warm-ups) and TFLOP/s of the causal work (4 * head_dim * heads per visible query-key pair). Every
output is checked against a float32 reference of the first two requests first. `--base DIR` also times
DIR's `rxf/plugins/attention/triton/extend.py` (`git archive COMMIT | tar -x -C DIR`) at its default.
Figures go to $OUT/gpu_attn_extend.json; `--pick CASE` prints `RXF_EXTEND=` the case's fastest setting
of this tree (empty for the default) last, for a run after it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SCALING = HEAD_DIM ** -0.5
CASES = {  # name: (prefix per request, new tokens per request, FP8 pool)
    "chunk": ([0] * 16, None, False),
    "chunk-fp8": ([0] * 16, None, True),
    "long": ([0, 0], [8192, 8192], False),
    "prefix": ([2048] * 8, [512] * 8, False),
}
CONFIGS = ("64,64,4,3 128,64,8,2 128,64,8,3 128,128,8,2 128,64,4,2 64,128,4,2 p64,64,4,2 p128,64,8,2 p128,64,8,3 "
           "p128,128,8,2 p128,64,4,2 p128,32,4,2")


class Case:
    """One launch's inputs over a scattered pool holding every request's prefix and new K/V."""

    def __init__(self, prefix: list[int], new: list[int], fp8: bool) -> None:
        self.prefix, self.new = prefix, new
        dev, bs = "cuda", len(new)
        total = [p + n for p, n in zip(prefix, new, strict=True)]
        slots = sum(total)
        kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        k_all = torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev)
        v_all = torch.randn(slots, KV_HEADS, HEAD_DIM, device=dev)
        if fp8:  # values the pool holds exactly, so that the reference and the kernel see the same keys
            k_all, v_all = k_all.to(kv_dtype).float(), v_all.to(kv_dtype).float()
        perm = torch.randperm(slots, device=dev)
        self.k_buf = torch.empty(slots, KV_HEADS, HEAD_DIM, device=dev, dtype=kv_dtype)
        self.v_buf = torch.empty_like(self.k_buf)
        self.k_buf[perm] = k_all.to(kv_dtype)
        self.v_buf[perm] = v_all.to(kv_dtype)
        self.req_to_token = torch.zeros(bs, max(total), dtype=torch.int32, device=dev)
        self.keys, self.values, news = [], [], []
        start = 0
        for b, t in enumerate(total):
            self.req_to_token[b, :t] = perm[start:start + t].int()
            self.keys.append(k_all[start:start + t])
            self.values.append(v_all[start:start + t])
            news.append(slice(start + prefix[b], start + t))
            start += t
        self.k = torch.cat([k_all[s] for s in news]).bfloat16()
        self.v = torch.cat([v_all[s] for s in news]).bfloat16()
        self.q = torch.randn(sum(new), HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        i32 = {"device": dev, "dtype": torch.int32}
        self.extend_lens = torch.tensor(new, **i32)
        self.prefix_lens = torch.tensor(prefix, **i32)
        self.qo_start = torch.cumsum(self.extend_lens, 0, dtype=torch.int32) - self.extend_lens
        self.req_pool_indices = torch.arange(bs, **i32)
        self.scale = torch.ones((), device=dev) if fp8 else None
        self.flops = sum(4 * HEAD_DIM * HEADS * (n * p + n * (n + 1) // 2) for p, n in zip(prefix, new, strict=True))

    def run(self, extend_attention: Callable[..., None], **launch: Any) -> None:
        fp8 = {} if self.scale is None else {"k_scale": self.scale, "v_scale": self.scale}
        extend_attention(self.q, self.k, self.v, self.out, self.k_buf, self.v_buf, self.req_to_token,
                         self.req_pool_indices, self.prefix_lens, self.extend_lens, self.qo_start, max(self.new),
                         SCALING, **fp8, **launch)

    def error(self) -> float:
        """Relative error of `out` for the first two requests against float32 attention."""
        worst, row = 0.0, 0
        for b in range(min(2, len(self.new))):
            p, n = self.prefix[b], self.new[b]
            q = self.q[row:row + n].float().transpose(0, 1)  # [H, n, D]
            k = self.keys[b].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
            v = self.values[b].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
            s = (q @ k.transpose(1, 2)) * SCALING
            visible = torch.arange(p + n, device="cuda")[None, :] <= (p + torch.arange(n, device="cuda"))[:, None]
            ref = (s.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)
            got = self.out[row:row + n].float()
            worst = max(worst, ((got - ref).norm() / ref.norm()).item())
            row += n
        return worst


def time_us(fn: Callable[[], Any], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def flashinfer_us(case: Case) -> float | str:
    """FlashInfer's ragged causal prefill over the new tokens (no prefix, model-dtype K/V only)."""
    try:
        import flashinfer
    except ImportError as e:
        return f"no flashinfer: {e}"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    indptr = torch.tensor([0, *torch.tensor(case.new).cumsum(0).tolist()], dtype=torch.int32)
    wrapper.plan(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=HEADS, num_kv_heads=KV_HEADS,
                 head_dim_qk=HEAD_DIM, causal=True, sm_scale=SCALING, q_data_type=torch.bfloat16)
    out = wrapper.run(case.q, case.k, case.v)
    case.out.copy_(out)
    if (err := case.error()) > 2e-2:
        return f"err {err:.3g}"
    return time_us(lambda: wrapper.run(case.q, case.k, case.v))


def setting_of(label: str) -> str:
    """A label (`pm128n64w8s2`) as `RXF_EXTEND` takes it (`p128,64,8,2`)."""
    return label[0] * label.startswith("p") + ",".join(re.findall(r"\d+", label))


def load_base(base: str) -> Any:
    path = Path(base) / "rxf/plugins/attention/triton/extend.py"
    spec = importlib.util.spec_from_file_location("base_extend", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extend_attention


def main() -> None:
    from rxf.plugins.attention.triton.extend import extend_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="", help="an older tree whose extend kernel is timed beside this one's")
    ap.add_argument("--configs", nargs="*", default=CONFIGS.split(), help="[p]BLOCK_M,BLOCK_N,warps,stages")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--pick", default="", help="a case: print RXF_EXTEND=<its fastest setting> last")
    args = ap.parse_args()
    rng = random.Random(0)
    torch.manual_seed(0)
    kernels: dict[str, tuple[Callable[..., None], dict[str, int]]] = {"default": (extend_attention, {})}
    if args.base:
        kernels["base"] = (load_base(args.base), {})
    for cfg in args.configs:  # "p" first: the GQA heads of a KV head packed into a block's rows
        pack = cfg.startswith("p")
        m, n, w, s = map(int, cfg.lstrip("p").split(","))
        kernels[cfg[0] * pack + f"m{m}n{n}w{w}s{s}"] = (extend_attention, {
            "block_m": m, "block_n": n, "num_warps": w, "num_stages": s, "pack_gqa": pack})
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    out_dir = Path(os.environ.get("OUT", "/tmp/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        prefix, new, fp8 = CASES[name]
        new = new or [rng.randint(512, 1536) for _ in prefix]
        case = Case(prefix, new, fp8)
        row: dict[str, Any] = {"tokens": sum(new), "gflop": round(case.flops / 1e9, 1)}
        for label, (fn, launch) in kernels.items():
            try:
                case.run(fn, **launch)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a setting past the card's shared memory, say
                row[label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            if (err := case.error()) > 2e-2:
                row[label] = f"err {err:.3g}"
                continue
            us = time_us(lambda fn=fn, launch=launch, case=case: case.run(fn, **launch))
            row[label] = {"us": round(us, 1), "tflops": round(case.flops / us / 1e6, 1)}
        if not any(case.prefix) and not fp8:
            us = flashinfer_us(case)
            row["flashinfer"] = us if isinstance(us, str) else {"us": round(us, 1),
                                                                "tflops": round(case.flops / us / 1e6, 1)}
        results[name] = row
        print(name, json.dumps(row), flush=True)
        (out_dir / "gpu_attn_extend.json").write_text(json.dumps(results, indent=1))
    if args.pick:
        timed = {label: r["us"] for label, r in results[args.pick].items()
                 if isinstance(r, dict) and label not in ("base", "flashinfer")}
        best = min(timed, key=timed.__getitem__)
        print(f"RXF_EXTEND={'' if best == 'default' else setting_of(best)}")


if __name__ == "__main__":
    main()
