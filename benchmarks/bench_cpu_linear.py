"""Dense bf16 CPU linears packed for oneDNN (`rxf.plugins.quantization.cpu_packing`, `pack_for_device`)
against F.linear on the plain weight, on the demo model, in one process: two ModelRunners on the same checkpoint, one loaded with
`RXF_CPU_WEIGHT_PACKING=1` and one with `=0`, timed in alternation (rounds), so load changes on a
shared machine hit both alike.

    RXF_CACHE_DIR=~/.cache/rxf python benchmarks/bench_cpu_linear.py [--threads 1] [--batches 1,16]
        [--dtype bfloat16] [--prompt-len 128] [--steps 16] [--rounds 4]

Per batch size: prefill of `bs` prompts (ms), then decode tok/s over `steps` steps (after 3 warm-up
steps), medians over rounds; the largest |difference| of the two runners' prefill logits; the
1-minute load average at the end. The cpu backend's decode kernel compiles at start-up
(RXF_CPU_ATTENTION_COMPILE=startup), so no timed step runs before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RXF_CPU_ATTENTION_COMPILE", "startup")

import torch  # noqa: E402

from rxf.core.config import load_config  # noqa: E402
from rxf.core.forward import ForwardMode  # noqa: E402
from rxf.core.registry import PluginRegistry  # noqa: E402
from rxf.core.runner.model_runner import ModelInput, ModelRunner  # noqa: E402
from rxf.entrypoints.demo_model import resolve_model_path  # noqa: E402


def make_runner(path: str, dtype: str, pack: bool) -> ModelRunner:
    os.environ["RXF_CPU_WEIGHT_PACKING"] = "1" if pack else "0"  # read at load
    cfg = load_config({"model": {"path": path, "dtype": dtype}, "attention": {"backend": "cpu"},
                       "runtime": {"device": "cpu", "cpu_compile": "off"}, "scheduler": {"max_running_requests": 32},
                       "cache": {"max_total_tokens": 16384}})
    return ModelRunner(cfg, PluginRegistry.load(), path)


def prefill(r: ModelRunner, bs: int, plen: int) -> tuple[list[int], list[int], float, torch.Tensor]:
    r.req_to_token_pool.clear()
    r.token_to_kv_pool.clear()
    prompts = [[(7 * i + j) % 4000 + 5 for j in range(plen)] for i in range(bs)]
    rows = [r.req_to_token_pool.alloc() for _ in prompts]
    slots = r.token_to_kv_pool.alloc(bs * plen)
    start = time.perf_counter()
    logits = r.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in prompts for t in p], [0] * bs, [plen] * bs, slots))
    return rows, [plen] * bs, time.perf_counter() - start, logits


def decode(r: ModelRunner, rows: list[int], lens: list[int], steps: int) -> float:
    """Seconds per decode step."""
    bs = len(rows)
    start = time.perf_counter()
    for _ in range(steps):
        r.forward(ModelInput(ForwardMode.DECODE, rows, [11] * bs, list(lens), [1] * bs, r.token_to_kv_pool.alloc(bs)))
        lens[:] = [n + 1 for n in lens]
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model_path("demo"))
    runners = {"packed": make_runner(path, args.dtype, True), "plain": make_runner(path, args.dtype, False)}
    assert runners["packed"].model.model.layers[0].self_attn.qkv_proj.packed_weight is not None
    for bs in map(int, args.batches.split(",")):
        step = {k: [] for k in runners}
        pre = {k: [] for k in runners}
        logits = {}
        for _ in range(args.rounds):
            for name, r in runners.items():
                rows, lens, seconds, logits[name] = prefill(r, bs, args.prompt_len)
                decode(r, rows, lens, 3)
                step[name].append(decode(r, rows, lens, args.steps))
                pre[name].append(seconds)
        med = {k: statistics.median(v) for k, v in step.items()}
        pmed = {k: statistics.median(v) for k, v in pre.items()}
        diff = (logits["packed"] - logits["plain"]).abs().max().item()
        print(f"{args.dtype}, {args.threads} thread(s), batch {bs}: decode packed {bs / med['packed']:.1f} tok/s, plain "
              f"{bs / med['plain']:.1f} (x{med['plain'] / med['packed']:.2f}); prefill packed {pmed['packed'] * 1e3:.0f} ms, "
              f"plain {pmed['plain'] * 1e3:.0f} (x{pmed['plain'] / pmed['packed']:.2f}); max |logit diff| {diff:.3g}; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
