"""One CPU decode step of the demo model, engine variants side by side in one process (issue 22).

    python benchmarks/bench_cpu_step.py [--variants plain packed compiled] [--threads 1 2] \
        [--batch 1 4 16] [--context 128] [--dtype bfloat16]

Variants (each a `ModelHarness` of the cpu backend on the same checkpoint, built in turn):
  plain     dense matmuls through F.linear (RXF_CPU_WEIGHT_PACKING=0), eager decode
  packed    bf16 weights packed for oneDNN at load (`cpu_packing.pack_dense`), eager decode
  compiled  packed, and the decode forward compiled whole (`runtime.cpu_compile = "startup"`); up to
            4 rows read the plain weights (`cpu_packing.keeps_plain_weight`, AVX512-BF16 CPUs)
  compiled-onednn  compiled, every batch on oneDNN's packed weights (the plain ones not kept)

    python benchmarks/bench_cpu_step.py --matmuls [--threads 1]   # the demo's matmuls alone

--matmuls: F.linear against the oneDNN-packed weight (`cpu_packing`) and, on an AVX512-BF16 CPU, the
few-row dot kernel over the plain weight, for the demo's projection shapes and its logits head, 1 /
4 / 16 / 256 rows, bf16, median of 50 calls; then the model's 121 matmuls in order at one row
(weights streaming from memory, as in a decode step), packed against dot, alternated.

Per batch size: a PREFILL of `--context`-token prompts, then blocks of DECODE steps, variant after
variant at each thread count in turn (a block of 6 steps, the first dropped), so a
change in the machine's load hits all alike. The machine may be shared: a block starts once the
other processes use under `--quiet-cores` (waiting up to 60 s), and is redone (up to 5 times) when
they used more during it. Prints each one's median step, the blocks redone, and the greedy tokens'
agreement with the first variant on 6 prompts (the demo chat question and 5 others).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

CHAT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
        2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
VARIANTS = {
    "plain": ({"runtime.cpu_compile": "off"}, "0"),
    "packed": ({"runtime.cpu_compile": "off"}, "1"),
    "compiled": ({"runtime.cpu_compile": "startup"}, "1"),
    "compiled-onednn": ({"runtime.cpu_compile": "startup"}, "1"),
}


def others_cores(during: Callable[[], None]) -> float:
    """Cores the rest of the machine used while `during` ran (its busy time less this process's)."""
    from rxf.core.runner.cpu_threads import machine_busy_s

    wall, busy, own = time.monotonic(), machine_busy_s(), time.process_time()
    during()
    wall, busy, own = time.monotonic() - wall, machine_busy_s() - busy, time.process_time() - own
    return max(0.0, busy - own) / wall


def quiet_block(block: Callable[[], None], quiet: float) -> int:
    """Run `block` once the others are quiet, again while they were not; returns the redos."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and others_cores(lambda: time.sleep(0.5)) >= quiet:
        pass
    for redo in range(5):
        if others_cores(block) < quiet:
            return redo
    return 5


def decode_block(h, state: dict, name: str, bs: int, threads: int, times: list[float]) -> None:
    """6 DECODE steps of `h` at `threads` threads; the last 5 steps' times into `times`."""
    from rxf.core.forward import ForwardMode
    from rxf.core.runner.model_runner import ModelInput

    times.clear()
    torch.set_num_threads(threads)
    for i in range(6):
        rows, lens = state[name]
        new = h.runner.token_to_kv_pool.alloc(bs)
        start = time.perf_counter()
        h.runner.forward(ModelInput(ForwardMode.DECODE, rows, [5] * bs, list(lens), [1] * bs, new))
        if i:
            times.append(time.perf_counter() - start)
        state[name] = (rows, [n + 1 for n in lens])


MATMULS = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "o": (576, 576), "head": (49152, 576)}  # (out, in)


def matmuls(threads: int) -> None:
    from rxf.plugins.quantization import cpu_packing

    torch.set_num_threads(threads)
    dot = cpu_packing.keeps_plain_weight()  # the few-row kernel over the plain weight runs here
    for name, (n, k) in MATMULS.items():
        w = torch.randn(n, k, dtype=torch.bfloat16)
        packed = cpu_packing.pack_dense(w)
        for rows in (1, 4, 16, 256):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            ways = {"F.linear": lambda: torch.nn.functional.linear(x, w),  # noqa: B023 - run at once
                    "packed": lambda: cpu_packing.dense_linear(x, packed, None, None)}  # noqa: B023
            if dot:
                ways["dot"] = lambda: cpu_packing.dense_linear(x, packed, w, None)  # noqa: B023
            us = {way: _median_us(fn, 50) for way, fn in ways.items()}
            print(f"{name} {n} x {k}, {rows:3d} rows, {threads} threads: "
                  + ", ".join(f"{way} {t:.0f} us" for way, t in us.items()), flush=True)
    # The whole model's matmuls in order, one row: the weights stream from memory, as in a decode step.
    shapes = [MATMULS[m] for m in ("qkv", "o", "gate_up", "down")] * 30 + [MATMULS["head"]]
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
    packs = [cpu_packing.pack_dense(w) for w in weights]
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, k in shapes}
    nbytes = sum(w.numel() * 2 for w in weights)
    ways = {"packed": lambda: [cpu_packing.dense_linear(xs[w.shape[1]], p, None, None) for w, p in zip(weights, packs, strict=True)]}
    if dot:
        ways["dot"] = lambda: [cpu_packing.dense_linear(xs[w.shape[1]], p, w, None) for w, p in zip(weights, packs, strict=True)]
    for _ in range(2):  # alternated
        for way, fn in ways.items():
            us = _median_us(fn, 9)
            print(f"the demo's {len(shapes)} matmuls, 1 row, {threads} threads, {way}: {us / 1e3:.2f} ms "
                  f"({nbytes / us / 1e3:.1f} GB/s)", flush=True)


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    from bench_cpu_attention import timed  # (benchmarks/ is the script's directory: on sys.path)

    return timed(fn, repeats) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--quiet-cores", type=float, default=0.15)
    p.add_argument("--matmuls", action="store_true", help="the matmuls alone, F.linear against packed")
    args = p.parse_args()
    if args.matmuls:
        for threads in args.threads:
            matmuls(threads)
        return

    from rxf.entrypoints.demo_model import resolve_model_path
    from rxf.plugins.quantization import cpu_packing
    from rxf.testing.model_harness import ModelHarness

    os.environ.setdefault("RXF_CPU_ATTENTION_COMPILE", "startup")
    harnesses = {}
    for name in args.variants:
        overrides, packing = VARIANTS[name]
        os.environ["RXF_CPU_WEIGHT_PACKING"] = packing  # read at load
        start = time.perf_counter()
        keeps_plain = cpu_packing.keeps_plain_weight
        if name == "compiled-onednn":
            cpu_packing.keeps_plain_weight = lambda: False
        harnesses[name] = ModelHarness(resolve_model_path("demo"), "cpu", thread_counts=tuple(args.threads), **{
            "model.dtype": args.dtype, "cache.max_total_tokens": max(args.batch) * (args.context + 40 * args.blocks * len(args.threads)) + 2048,
            "scheduler.max_running_requests": max(args.batch) + 8, **overrides})
        cpu_packing.keeps_plain_weight = keeps_plain
        print(f"{name}: engine built in {time.perf_counter() - start:.1f} s", flush=True)
    prompts = [CHAT] + [[(11 + 7 * i + 3 * j) % 49000 for j in range(30 + 9 * i)] for i in range(5)]
    greedy = {name: h.greedy(prompts, 32) for name, h in harnesses.items()}
    first = args.variants[0]
    for name in args.variants[1:]:
        same = sum(a == b for a, b in zip(greedy[first], greedy[name], strict=True))
        print(f"greedy tokens, {name} vs {first}: {same} of {len(prompts)} prompts identical over 32 tokens")
    for bs in args.batch:
        batch = [[(11 + 7 * i + 3 * j) % 49000 for j in range(args.context)] for i in range(bs)]
        state = {}
        with torch.inference_mode():
            for name, h in harnesses.items():
                rows, slots = h._start(batch)
                h._prefill(batch, rows, slots, all_logits=False)
                state[name] = (rows, [args.context] * bs)
            steps: dict[tuple[str, int], list[float]] = {(n, t): [] for n in harnesses for t in args.threads}
            redos = 0
            for _ in range(args.blocks):
                for threads in args.threads:  # (the count changes between blocks, never within)
                    for name, h in harnesses.items():
                        times: list[float] = []
                        redos += quiet_block(partial(decode_block, h, state, name, bs, threads, times), args.quiet_cores)
                        steps[name, threads] += times
        cells = ", ".join(f"{n} {t}t {statistics.median(v) * 1e3:.1f}" for (n, t), v in steps.items())
        print(f"{args.dtype} batch {bs:2d}, {args.context} keys, load average {os.getloadavg()[0]:.2f}, {redos} blocks "
              f"redone: median ms per step: {cells}", flush=True)


if __name__ == "__main__":
    main()
