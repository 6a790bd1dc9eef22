"""Tune the fused MoE kernels' block sizes on this GPU and write them into the table the kernels read
(`rxf/plugins/models/layers/fused_moe_tuned.json`, see `fused_moe_table.py`). One call, ~3-4 minutes
on an H200 at the defaults:

    python benchmarks/gpu_moe_tune.py [--experts 128 --hidden 2048 --inter 768 --top-k 8 --dtype bfloat16]
        [--tokens 1,2,4,8,16,32,64,128,256,512,1024,4096] [--budget-s 200] [--workers N] [--output FILE]
    python benchmarks/gpu_moe_tune.py --tiny     # CPU, TRITON_INTERPRET=1, toy shapes: checks the script

Defaults: Qwen3-30B-A3B's MoE layer (hidden 2048, moe_intermediate 768, 128 experts, top 8, bf16).
Only `fused_moe.fused_experts(..., config)` is called, so the search follows the kernels as they are.

Search, per token count M (uniform random routing, as a trained router spreads tokens):
  stage 1  block_m from 16 up to twice the mean rows per expert (M * top_k / E), block_n 32/64/128
           (the gate_up kernel's width for each of gate and up), down_block_n = 2 * block_n,
           block_k 64/128/256, 4 or 8 warps, 2-5 stages, group_m 1; configs whose pipelined tiles
           exceed the GPU's shared memory are skipped; the heuristic's own config is timed first.
  stage 2  the stage-1 winner with down_block_n 32-256 and, where an expert has several row blocks,
           group_m 1/8/16.
Compiling dominates a sweep (hundreds of variants, ~1 s each), so every candidate of a stage is
compiled first by worker processes (spawned, one CUDA context each) that fill Triton's on-disk
cache; the timing loop then only loads the binaries. Timing: a CUDA graph of R calls over R
rotating input sets (other tokens and routing each, so that a small M reads other experts' weights
instead of L2 hits), replayed until ~5 ms, median of 3 replays, per call. Every stage stops at its
share of --budget-s, keeping the best found so far (the heuristic is always measured).
Each M's winner is checked against the torch path (`experts_native`, float32) and written if it
beats the heuristic by > 2%; otherwise the heuristic's own config is written for that M. Every M
gets an entry because a call takes the entry tuned nearest its token count: with entries only where
the search won, a count whose heuristic measured best would take a neighbour's blocks (on an H100,
2026-12-06, 64 tokens would have run at the blocks tuned for 512).

Writes the table (merged into --output, default the package's file; with $OUT set, a copy to
$OUT/fused_moe_tuned.json, which the device tool brings back) and $OUT/gpu_moe_tune.json (every
M: heuristic and tuned time, the config, candidates timed and failed); prints a table last.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Problem:
    experts: int
    hidden: int
    inter: int
    top_k: int
    dtype: torch.dtype
    device: str


QWEN3_30B_A3B = Problem(128, 2048, 768, 8, torch.bfloat16, "cuda")
TINY = Problem(8, 64, 32, 2, torch.float32, "cpu")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def until(self, fraction: float) -> float:
        """Seconds left until `fraction` of the budget has passed (<= 0: past it)."""
        return self.start + fraction * self.seconds - time.perf_counter()


# ---------------------------------------------------------------- candidates
def shared_memory_limit(p: Problem) -> int:
    if p.device != "cuda":
        return 1 << 30
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"])
    except Exception:  # an older or newer driver API: H100/H200's per-block limit
        return 227 * 1024


def fits(cfg: Any, p: Problem, limit: int) -> bool:
    """Both kernels' pipelined tiles (x and two weight tiles for gate_up, act and one for down) fit."""
    item = torch.finfo(p.dtype).bits // 8
    gate_up = cfg.block_m * cfg.block_k + 2 * cfg.block_k * cfg.block_n
    down = cfg.block_m * cfg.block_k + cfg.block_k * (cfg.down_block_n or cfg.block_n)
    return max(gate_up, down) * item * cfg.num_stages <= limit


def rows_per_expert(m: int, p: Problem) -> float:
    return m * p.top_k / p.experts


def stage1(m: int, p: Problem, limit: int, tiny: bool) -> list[Any]:
    from rxf.plugins.models.layers.fused_moe import BlockConfig

    if tiny:  # a handful of configs: enough to exercise every step of the script
        return [BlockConfig(16, 16, 32, down_block_n=16), BlockConfig(16, 32, 16, down_block_n=32, num_stages=2)]
    rows = rows_per_expert(m, p)
    out = []
    for bm in (b for b in (16, 32, 64, 128) if b == 16 or b <= 2 * rows):
        for bn in (32, 64, 128):
            for bk in (64, 128, 256):
                for warps in (4, 8):
                    for stages in (2, 3, 4, 5):
                        cfg = BlockConfig(bm, bn, bk, down_block_n=2 * bn, group_m=1, num_warps=warps,
                                          num_stages=stages)
                        if fits(cfg, p, limit):
                            out.append(cfg)
    return out


def stage2(m: int, p: Problem, best: Any, limit: int) -> list[Any]:
    several_blocks = rows_per_expert(m, p) >= 2 * best.block_m
    out = []
    for dbn in (32, 64, 128, 256):
        for gm in (1, 8, 16) if several_blocks else (1,):
            cfg = dataclasses.replace(best, down_block_n=dbn, group_m=gm)
            if cfg != best and fits(cfg, p, limit):
                out.append(cfg)
    return out


# ---------------------------------------------------------------- inputs
def make_weights(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=p.device).manual_seed(0)
    w13 = torch.randn(p.experts, 2 * p.inter, p.hidden, device=p.device, generator=gen).mul_(p.hidden**-0.5)
    w2 = torch.randn(p.experts, p.hidden, p.inter, device=p.device, generator=gen).mul_(p.inter**-0.5)
    return w13.to(p.dtype), w2.to(p.dtype)


def make_inputs(p: Problem, m: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """`count` sets of (x, topk_weights, topk_ids) for m tokens, each routed differently."""
    from rxf.plugins.models.layers.moe import select_experts

    gen = torch.Generator(device=p.device).manual_seed(seed)
    sets = []
    for _ in range(count):
        x = torch.randn(m, p.hidden, device=p.device, generator=gen).to(p.dtype)
        weights, ids = select_experts(torch.randn(m, p.experts, device=p.device, generator=gen), p.top_k, True)
        sets.append((x, weights, ids))
    return sets


def rotating_sets(m: int) -> int:
    return 8 if m <= 256 else 4 if m <= 1024 else 2


# ---------------------------------------------------------------- compile (worker processes)
_WORKER: dict[str, Any] = {}


def _worker_init(p: Problem) -> None:
    import rxf.plugins.models.layers.fused_moe  # noqa: F401  (Triton imported once per worker)

    w13 = torch.zeros(p.experts, 2 * p.inter, p.hidden, dtype=p.dtype, device=p.device)
    w2 = torch.zeros(p.experts, p.hidden, p.inter, dtype=p.dtype, device=p.device)
    _WORKER.update(p=p, w13=w13, w2=w2, inputs=make_inputs(p, 4, 1, seed=1)[0])


def _compile(configs: list[Any]) -> list[tuple[Any, str | None]]:
    """Run each config once on a tiny problem of the real shapes (the same kernel variants as the
    timed calls: token counts are not specialised on); an error is the config's failure."""
    from rxf.plugins.models.layers.fused_moe import fused_experts

    x, weights, ids = _WORKER["inputs"]
    out = []
    for cfg in configs:
        try:
            fused_experts(x, _WORKER["w13"], _WORKER["w2"], weights, ids, cfg)
            if x.is_cuda:
                torch.cuda.synchronize()
            out.append((cfg, None))
        except Exception as e:
            out.append((cfg, f"{type(e).__name__}: {e}"[:160]))
    return out


def precompile(p: Problem, configs: Iterable[Any], workers: int, seconds: float) -> dict[Any, str]:
    """Compile `configs` in `workers` processes within `seconds`; returns the failed ones' errors.
    Whatever is not compiled in time compiles on first use in the timing loop."""
    todo = sorted(set(configs), key=str)
    if workers < 1 or not todo:
        return {}
    start, failed = time.perf_counter(), {}
    chunk = max(1, math.ceil(len(todo) / (workers * 4)))
    pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                  initargs=(p,))
    futures = [pool.submit(_compile, todo[i : i + chunk]) for i in range(0, len(todo), chunk)]
    done, pending = cf.wait(futures, timeout=max(1.0, seconds))
    for f in done:
        try:
            failed.update({cfg: err for cfg, err in f.result() if err})
        except Exception as e:  # a worker died: its configs compile in the timing loop
            print(f"compile worker failed: {type(e).__name__}: {e}"[:200])
    pool.shutdown(wait=False, cancel_futures=True)
    print(f"compiled {len(todo)} configs ({len(pending)} of {len(futures)} batches unfinished, {len(failed)} "
          f"failed) with {workers} workers in {time.perf_counter() - start:.1f}s", flush=True)
    return failed


# ---------------------------------------------------------------- timing
def time_per_call(call: Callable[[tuple[torch.Tensor, ...]], Any], sets: list[tuple[torch.Tensor, ...]],
                  cuda: bool) -> float:
    """Seconds per call over the rotating `sets`: on CUDA a graph of one call per set, replayed."""
    for s in sets:  # compiles (or loads) the variant; raises where it cannot run
        call(s)
    if not cuda:
        start = time.perf_counter()
        for s in sets:
            call(s)
        return (time.perf_counter() - start) / len(sets)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            call(s)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, min(50, math.ceil(5.0 / max(begin.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(3):
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3 / (replays * len(sets)))
    del graph
    return statistics.median(samples)


def search(p: Problem, m: int, configs: list[Any], w13: torch.Tensor, w2: torch.Tensor,
           sets: list[tuple[torch.Tensor, ...]], failed: dict[Any, str], seconds: float,
           timed: dict[Any, float]) -> None:
    """Time every config not yet in `timed` (config -> seconds per call) until `seconds` pass."""
    from rxf.plugins.models.layers.fused_moe import fused_experts

    stop = time.perf_counter() + seconds
    for i, cfg in enumerate(configs):
        if cfg in timed or cfg in failed:
            continue
        if i and time.perf_counter() > stop:  # the first config (the heuristic's) is always timed
            break
        try:
            timed[cfg] = time_per_call(lambda s, c=cfg: fused_experts(s[0], w13, w2, s[1], s[2], c), sets,
                                       p.device == "cuda")
        except Exception as e:  # out of shared memory or registers at launch, ...
            failed[cfg] = f"{type(e).__name__}: {e}"[:160]


def check(cfg: Any, weights: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> float:
    """Relative error of the config's output against the torch path in float32 on the same weights
    (`weights`: w13, w2 and their float32 copies)."""
    from rxf.plugins.models.layers.fused_moe import fused_experts
    from rxf.plugins.models.layers.moe import experts_native

    w13, w2, w13_f32, w2_f32 = weights
    x, topk_weights, ids = inputs
    ref = experts_native(x.float(), w13_f32, w2_f32, topk_weights, ids)
    out = fused_experts(x, w13, w2, topk_weights, ids, cfg).float()
    return ((out - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- main
def tune(p: Problem, tokens: list[int], budget: Budget, workers: int, tiny: bool) -> dict[int, dict[str, Any]]:
    from rxf.plugins.models.layers.fused_moe import pick_config

    limit = shared_memory_limit(p)
    w13, w2 = make_weights(p)
    sets = {m: make_inputs(p, m, 1 if tiny else rotating_sets(m), seed=m) for m in tokens}
    heuristic = {m: pick_config(m * p.top_k, p.experts, torch.finfo(p.dtype).bits // 8) for m in tokens}
    first = {m: [heuristic[m], *stage1(m, p, limit, tiny)] for m in tokens}
    print(f"stage 1: {sum(map(len, first.values()))} timings of {len({c for cs in first.values() for c in cs})} "
          f"distinct configs over {len(tokens)} token counts", flush=True)
    failed = precompile(p, (c for cs in first.values() for c in cs), workers, budget.until(0.40))
    timed: dict[int, dict[Any, float]] = {m: {} for m in tokens}
    for i, m in enumerate(tokens):  # each M gets an equal share of what is left of the stage
        search(p, m, first[m], w13, w2, sets[m], failed, budget.until(0.75) / (len(tokens) - i), timed[m])
        print(f"M={m}: {len(timed[m])} timed, best {min(timed[m].values()) * 1e6:.1f} us "
              f"(heuristic {timed[m].get(heuristic[m], math.nan) * 1e6:.1f})", flush=True)
    if not all(timed.values()):
        raise RuntimeError(f"the heuristic's config failed for M in {[m for m in tokens if not timed[m]]}: "
                           f"{[failed.get(heuristic[m]) for m in tokens if not timed[m]]}")
    second = {m: stage2(m, p, min(timed[m], key=timed[m].get), limit) for m in tokens}
    failed.update(precompile(p, (c for cs in second.values() for c in cs), workers, budget.until(0.85)))
    all_weights = (w13, w2, w13.float(), w2.float())
    results: dict[int, dict[str, Any]] = {}
    for i, m in enumerate(tokens):
        search(p, m, second[m], w13, w2, sets[m], failed, budget.until(0.95) / (len(tokens) - i), timed[m])
        best = min(timed[m], key=timed[m].get)
        base = timed[m].get(heuristic[m], math.inf)
        try:
            err = check(best, all_weights, sets[m][0])
        except Exception as e:  # e.g. the GPU in an error state: nothing more is written
            print(f"M={m}: check failed: {type(e).__name__}: {e}"[:300], flush=True)
            err = math.inf
        won = timed[m][best] < 0.98 * base and err < 1e-2
        chosen = best if won else dataclasses.replace(  # the table's blocks are explicit: no 0 down_block_n
            heuristic[m], down_block_n=heuristic[m].down_block_n or heuristic[m].block_n)
        errors = [e for c, e in failed.items() if c in {*first[m], *second[m]}]
        results[m] = {"tuned_us": timed[m][best] * 1e6, "heuristic_us": base * 1e6, "rel_err": err,
                      "won": won, "best": dataclasses.asdict(best), "config": dataclasses.asdict(chosen),
                      "timed": len(timed[m]),
                      "failed": len(errors), "failures_seen": sorted(set(errors))[:3]}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU under TRITON_INTERPRET=1, toy shapes")
    ap.add_argument("--experts", type=int, default=QWEN3_30B_A3B.experts)
    ap.add_argument("--hidden", type=int, default=QWEN3_30B_A3B.hidden)
    ap.add_argument("--inter", type=int, default=QWEN3_30B_A3B.inter, help="expert width on one rank")
    ap.add_argument("--top-k", type=int, default=QWEN3_30B_A3B.top_k)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--budget-s", type=float, default=200.0, help="the whole search, compiles included")
    ap.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--output", type=Path, default=None, help="table file (default: the package's)")
    args = ap.parse_args()
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--tiny runs the kernels on the CPU: set TRITON_INTERPRET=1")
        p, tokens = TINY, [1, 4, 16]
    else:
        p = Problem(args.experts, args.hidden, args.inter, args.top_k, getattr(torch, args.dtype), "cuda")
        tokens = sorted({int(t) for t in args.tokens.split(",")})
    from rxf.plugins.models.layers import fused_moe_table

    device_name = torch.cuda.get_device_name() if p.device == "cuda" else "cpu"
    key = fused_moe_table.table_key(p.experts, p.inter, p.hidden, p.dtype, device_name)
    output = args.output or (Path(os.environ.get("OUT", "/tmp")) / "fused_moe_tuned.json" if args.tiny
                             else fused_moe_table.TABLE_FILE)
    budget = Budget(args.budget_s)
    results = tune(p, tokens, budget, min(args.workers, 2) if args.tiny else args.workers, args.tiny)
    written = {m: r["config"] for m, r in results.items()}
    output.parent.mkdir(parents=True, exist_ok=True)
    fused_moe_table.write_entries(key, written, output)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        if output.is_file() and output.resolve() != (Path(out_dir) / "fused_moe_tuned.json").resolve():
            shutil.copy(output, Path(out_dir) / "fused_moe_tuned.json")
        report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                  "device": device_name, "torch": torch.__version__, "key": key,
                  "seconds": time.perf_counter() - budget.start, "by_tokens": results}
        (Path(out_dir) / "gpu_moe_tune.json").write_text(json.dumps(report, indent=1))
    print(f"\n{key}: {sum(r['won'] for r in results.values())} of {len(tokens)} token counts tuned, the others "
          f"the heuristic's blocks, written to {output} "
          f"in {time.perf_counter() - budget.start:.0f}s")
    print("| tokens | heuristic us | best us | speed-up | best written | rel err | best (m, n, k, down_n, group, warps, stages) |")
    print("|---|---|---|---|---|---|---|")
    for m, r in results.items():
        c = r["best"]
        cfg = ", ".join(str(c[f]) for f in fused_moe_table.FIELDS)
        print(f"| {m} | {r['heuristic_us']:.1f} | {r['tuned_us']:.1f} | {r['heuristic_us'] / r['tuned_us']:.2f}x | "
              f"{'yes' if r['won'] else 'no'} | {r['rel_err']:.1e} | {cfg} |")


if __name__ == "__main__":
    main()
