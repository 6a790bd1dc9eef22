"""Where a decode step's time goes on the GPU (issue 4's profile): one call on the GPU machine.

    python benchmarks/gpu_profile.py [--preset llama3-8b] [--phases gemv,qgemv,step,attn] [--backends triton,flashinfer]
                                     [--gemv suggested|RXF_GEMV-value] [--quantization fp8]

Phases (each guarded like gpu_decode.py's; figures go to $OUT/gpu_profile.json, traces beside it):
  gemv   each projection of the preset at batch 1, 2, 4, 8 (bf16): cuBLAS, cuBLASLt and a sweep of rxf's
         Triton GEMV settings, GPU time over rotating weight copies (`gpu_gemv.py`); prints the
         RXF_GEMV value the figures favour
  qgemv  (not in the default phases) each projection at batch 1, 2, 4, 8 in each quantized weight
         format (FP8 row scales, FP8 128 x 128 blocks, int4 group 128): the method's current path
         (activation quantization + torch._scaled_mm / the block-scaled GEMM, int4_linear) vs a
         sweep of the weight-only decode GEMV's settings, bf16 cuBLAS beside them, GPU time over
         rotating weight copies (`gpu_qgemv.py`); prints the RXF_QGEMV value the figures favour
  step   the in-process engine (ModelRunner + Scheduler, each of `--backends`) at batch 1 with CUDA graphs:
         median wall time of a whole scheduler step, GPU time of the decode graph alone (replayed
         back to back), and a torch.profiler trace of 8 steps summarised as kernel time by category,
         top kernels, idle GPU gaps, and the host calls that fill them; with `--gemv VALUE` (or
         `--gemv suggested`: the gemv phase's choice in this call) each backend runs again with
         RXF_GEMV=VALUE
  attn   decode attention kernel time (GPU time from the profiler, no launch overhead: the engine
         replays it from CUDA graphs) for triton launch settings vs flashinfer, at realistic shapes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import gzip
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode as gd  # noqa: E402  (the sibling benchmark: presets, checkpoint, engine, cases)
import gpu_gemv  # noqa: E402
import gpu_qgemv  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
RESULTS: dict[str, Any] = {}


# ---------------------------------------------------------------- step + profile
_CATEGORIES = (("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "sm90")),
               ("attention", ("_decode", "attention", "batch")),
               ("norm", ("norm",)), ("rope", ("rope", "rotary")), ("rope+kv store", ("store_kv",)),
               ("activation", ("silu", "act_and_mul")),
               ("copy/index", ("copy", "index", "scatter", "gather", "fill", "cat")),
               ("sampling", ("argmax", "softmax", "topk", "sort", "reduce", "max")))


def _category(name: str) -> str:
    low = name.lower()
    for cat, keys in _CATEGORIES:
        if any(key in low for key in keys):
            return cat
    return "other"


def summarise_trace(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Kernel time per category, the top kernels and the GPU's idle gaps, per decode step."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_cat[_category(e["name"])] += e["dur"] / steps
        by_name[e["name"]][0] += e["dur"] / steps
        by_name[e["name"]][1] += 1 / steps
    gaps = []
    for prev, nxt in zip(kernels, kernels[1:], strict=False):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap > 3:
            gaps.append((gap, prev["name"][:60], nxt["name"][:60], nxt["ts"]))
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"] if kernels else 0
    # Host calls that overlap the largest gaps: what the GPU waits for.
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "cuda_runtime",
                                                                          "user_annotation")]
    gap_hosts: dict[str, float] = defaultdict(float)
    for gap, _, _, end in gaps:
        start = end - gap
        for e in cpu:
            lo, hi = max(start, e["ts"]), min(end, e["ts"] + e["dur"])
            if hi > lo and e.get("cat") in ("cuda_runtime", "python_function", "user_annotation"):
                gap_hosts[e["name"][:80]] += (hi - lo) / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    # Under programmatic dependent launch a kernel starts while the one before it runs, so durations
    # overlap and their sum overstates the step. What a kernel adds to the step is how far it moves the
    # latest end seen so far: end - max(latest end before it, its start), the idle before it apart.
    added_cat: dict[str, float] = defaultdict(float)
    added_name: dict[str, float] = defaultdict(float)
    latest = kernels[0]["ts"] if kernels else 0.0
    for e in sorted(kernels, key=lambda e: e["ts"] + e["dur"]):
        end = e["ts"] + e["dur"]
        if end <= latest:
            continue
        added_cat["idle"] += max(0.0, e["ts"] - latest) / steps
        added = (end - max(latest, e["ts"])) / steps
        added_cat[_category(e["name"])] += added
        added_name[e["name"]] += added
        latest = end
    return {
        "kernels_per_step": len(kernels) / steps, "gpu_busy_us_per_step": busy / steps,
        "span_us_per_step": span / steps, "idle_us_per_step": (span - busy) / steps,
        "by_category_us": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": n[:120], "us_per_step": v[0], "calls_per_step": v[1]} for n, v in top],
        "added_by_category_us": dict(sorted(added_cat.items(), key=lambda kv: -kv[1])),
        "added_top_kernels_us": {n[:120]: v for n, v in sorted(added_name.items(), key=lambda kv: -kv[1])[:25]},
        "gaps_over_3us_per_step": len(gaps) / steps, "gap_us_per_step": sum(g[0] for g in gaps) / steps,
        "largest_gaps": [{"us": g[0], "after": g[1], "before": g[2]} for g in sorted(gaps, reverse=True)[:12]],
        "host_during_gaps_us_per_step": dict(sorted(gap_hosts.items(), key=lambda kv: -kv[1])[:25]),
    }


@contextlib.contextmanager
def gemv_env(value: str | None):
    """RXF_GEMV=value for the engines built inside (the layers read it once per process: reset)."""
    from rxf.plugins.models.layers import gemv

    before = os.environ.get(gemv.ENV)
    if value is not None:
        os.environ[gemv.ENV] = value
    gemv._from_env.cache_clear()
    try:
        yield
    finally:
        os.environ.pop(gemv.ENV, None)
        if before is not None:
            os.environ[gemv.ENV] = before
        gemv._from_env.cache_clear()


def step_phase(p: gd.Preset, model_dir: Path, backend: str, label: str, quantization: str | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    sched = gd._engine(model_dir, backend, 64, 64 * 512 + 4096, random_load=not p.on_disk, quantization=quantization)
    graphs = sched.runner.cuda_graphs
    assert graphs is not None, "CUDA graphs are off"
    gd._add(sched, 1, 128, 4000, p.vocab, "p")
    for _ in range(40):
        sched.step()
    torch.cuda.synchronize()
    res: dict[str, Any] = {}
    for label in ("gc_default", "gc_frozen"):
        if label == "gc_frozen":
            gc.collect()
            gc.freeze()  # long-lived objects out of the collector's generations
        collections = {"n": 0}

        def count(phase: str, info: dict[str, Any], c: dict[str, int] = collections) -> None:
            c["n"] += phase == "start" and info["generation"] == 2

        gc.callbacks.append(count)
        walls = []
        for _ in range(300):
            start = time.perf_counter()
            sched.step()  # ends in the host read of the sampled token: a whole step
            walls.append(time.perf_counter() - start)
        gc.callbacks.remove(count)
        q = statistics.quantiles(walls, n=100)
        res[label] = {"mean_us": statistics.fmean(walls) * 1e6, "p50_us": q[49] * 1e6, "p90_us": q[89] * 1e6,
                      "p99_us": q[98] * 1e6, "max_us": max(walls) * 1e6, "gen2_collections": collections["n"]}
        print(label, json.dumps(res[label]), flush=True)
    wall_us = statistics.median(walls) * 1e6
    graph = graphs.graphs[1]
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    start_evt.record()
    for _ in range(50):
        graph.replay()
    end_evt.record()
    end_evt.synchronize()
    graph_us = start_evt.elapsed_time(end_evt) * 1e3 / 50
    res.update(step_wall_us=wall_us, graph_replay_us=graph_us, outside_graph_us=wall_us - graph_us, tok_s=1e6 / wall_us)
    print(f"{label} batch 1: step {wall_us:.0f} us, graph alone {graph_us:.0f} us "
          f"({1e6 / wall_us:.1f} tok/s)", flush=True)
    steps = 8
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
        for _ in range(steps):
            with record_function("scheduler.step"):
                sched.step()
        torch.cuda.synchronize()
    path = OUT / f"trace-{label}-b1.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(str(path) + ".gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    res["profile"] = summarise_trace(trace, steps)
    res["host_ops_top"] = [
        {"name": e.key[:80], "self_cpu_us_per_step": e.self_cpu_time_total / steps, "calls": e.count / steps}
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    ]
    RESULTS[f"step_{label}"] = res
    print(json.dumps(res, indent=1)[:6000], flush=True)
    while sched.has_work:
        for r in sched.running:
            r.to_abort = True
        sched.step()


# ---------------------------------------------------------------- attention decode kernels
def attn_phase(p: gd.Preset) -> None:
    from rxf.core.forward import ForwardMode
    from rxf.core.registry import PluginRegistry
    from rxf.plugins.attention.triton.decode import counters_needed, decode_attention

    registry = PluginRegistry.load()
    shapes = [(1, 4095), (16, 4095), (64, 1023), (256, 511)]
    triton_cls = registry.attention_backend("triton")
    out: dict[str, Any] = {}
    for bs, prefix in shapes:
        case = gd.AttentionCase.make(p, ForwardMode.DECODE, bs, prefix, 1)
        case.args = (case.q, case.k, case.v, case.layer, case.batch)
        label = f"b{bs} ctx{prefix + 1}"
        row: dict[str, Any] = {}
        ref_backend, ref = case.forward(registry.attention_backend("torch_native"))
        ref = ref.float()
        try:
            fi, _ = case.forward(registry.attention_backend("flashinfer"))
            row["flashinfer"], _ = gd.kernel_time_us(functools.partial(fi.forward, *case.args))
        except Exception as e:
            row["flashinfer"] = f"failed: {type(e).__name__}: {e}"[:200]
        tb, _ = case.forward(triton_cls)
        row["triton_default"], _ = gd.kernel_time_us(functools.partial(tb.forward, *case.args))
        k_buf, v_buf = case.ctx.token_to_kv_pool.get_kv_buffer(0)
        q = case.q.view(bs, p.heads, -1)
        seq = prefix + 1
        for splits in (1, 2, 4, 8, 16, 32, 64):
            if bs * splits * p.kv_heads > 8 * 132 * 8 or seq / splits < 32:
                continue
            nsplit = torch.full((bs,), splits, dtype=torch.int32, device="cuda")
            mid_o = torch.empty(bs, p.heads, splits, q.shape[-1], device="cuda")
            mid_lse = torch.empty(bs, p.heads, splits, device="cuda")
            counters = torch.zeros(counters_needed(bs, p.heads, p.kv_heads), dtype=torch.int32, device="cuda")
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (1, 2, 3):
                        o = torch.empty_like(q)
                        call = functools.partial(
                            decode_attention, q, k_buf, v_buf, o, case.batch.req_to_token_pool.req_to_token,
                            case.batch.req_pool_indices, case.batch.seq_lens, nsplit, splits, mid_o, mid_lse,
                            counters, case.layer.scaling, block_n=block_n, num_warps=warps, num_stages=stages)
                        try:
                            us, _ = gd.kernel_time_us(call, iters=10)
                            err = ((o.float().view_as(ref) - ref).norm() / ref.norm()).item()
                            row[f"s{splits} n{block_n} w{warps} st{stages}"] = round(us, 2) if err < 2e-2 else f"err {err:.3g}"
                        except Exception as e:
                            row[f"s{splits} n{block_n} w{warps} st{stages}"] = f"failed: {type(e).__name__}"[:60]
        timed = {k: v for k, v in row.items() if k.startswith("s") and isinstance(v, float)}
        best = min(timed, key=timed.get) if timed else None
        summary = {"flashinfer_us": row["flashinfer"], "triton_default_us": row["triton_default"],
                   "triton_best": best, "triton_best_us": timed.get(best) if best else None}
        print(label, json.dumps(summary), flush=True)
        out[label] = {"summary": summary, "all": row}
    RESULTS["attn"] = out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(gd.PRESETS), default="llama3-8b")
    ap.add_argument("--phases", default="gemv,step,attn")
    ap.add_argument("--backends", default="triton")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--random-weights", action="store_true",
                    help="step: no checkpoint written, the weights drawn at load (as gpu_decode.py's option)")
    ap.add_argument("--gemv", default=None, help="step phase: also run with RXF_GEMV=this ('suggested': the "
                    "gemv phase's choice)")
    ap.add_argument("--quantization", default=None,
                    help="step phase: model.quantization for the engine (e.g. fp8: online FP8 over the weights)")
    args = ap.parse_args()
    p, phases = gd.PRESETS[args.preset], args.phases.split(",")
    if args.random_weights:
        p = dataclasses.replace(p, on_disk=False)
    model_dir = args.model_dir or Path(f"/tmp/rxf-bench-{args.preset}")
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS.update(command=" ".join(sys.argv), device=torch.cuda.get_device_name(), torch=torch.__version__)
    suggested: list[str] = []
    if "gemv" in phases:
        gd.phase("gemv", lambda: suggested.append(gpu_gemv.gemv_phase(p, RESULTS)))
    if "qgemv" in phases:
        gd.phase("qgemv", lambda: gpu_qgemv.qgemv_phase(p, RESULTS))
    if "step" in phases:
        if not (model_dir / ("model.safetensors" if p.on_disk else "config.json")).exists():
            gd.phase("build", lambda: gd.build_checkpoint(p, model_dir))
        variants = {"": None}  # label suffix -> RXF_GEMV (None: as the environment says)
        if args.gemv == "suggested" and suggested:
            variants["+gemv"] = suggested[0]
        elif args.gemv not in (None, "suggested"):
            variants["+gemv"] = args.gemv
        for backend in args.backends.split(","):
            for suffix, value in variants.items():
                RESULTS[f"step_{backend}{suffix}_RXF_GEMV"] = value if value is not None else os.environ.get("RXF_GEMV")

                def run(b: str = backend, s: str = suffix, v: str | None = value) -> None:
                    with gemv_env(v):
                        step_phase(p, model_dir, b, b + s, args.quantization)

                gd.phase(f"step {backend}{suffix}", run)
    if "attn" in phases:
        gd.phase("attn", lambda: attn_phase(p))
    RESULTS["failed"] = gd.RESULTS.get("failed", [])
    (OUT / "gpu_profile.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
