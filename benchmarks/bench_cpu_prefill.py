"""Where a CPU serving run's prefill time goes: `compare_cpu.py`'s workloads replayed in-process
through the scheduler and runner (no HTTP, no IPC), step by step (issue 22).

    python benchmarks/bench_cpu_prefill.py [--workload shared-prefix|random] [--concurrency 16] \
        [--threads 1] [--set KEY=VALUE ...] [--steps]
    python benchmarks/bench_cpu_prefill.py --checkouts OLD NEW --rounds 3   # alternate two trees

Replay: the demo model with `examples/demo.toml`'s settings (of the checkout that rxf is imported from); the prompts are built as compare_cpu.py
builds them (the same generators and seed: 4 system prompts of 512 tokens, 8 questions of 32 tokens
each, shuffled; or 32 random 128-token prompts), 64 new tokens each (ignore_eos, greedy), at most
`--concurrency` in flight: a new one is queued when one finishes, as the bench client does.
Reported: TTFT per request (queued until its first token), tokens of prompt computed vs cached,
every step's mode, size and time (`--steps`), output tok/s.

With --checkouts, each round runs the replay once per checkout in a fresh interpreter with
PYTHONPATH set to it (so old and new code alternate within one run), and prints the medians.

    python benchmarks/bench_cpu_prefill.py --forward [--threads 1] [--profile]   # one forward's cost
    python benchmarks/bench_cpu_prefill.py --attention [--threads 1]             # its attention alone

--forward: PREFILL and EXTEND forwards of the shapes these workloads make (the best of 3), in ms
per token, through `ModelHarness` (cpu backend, bf16); --profile adds torch.profiler's top ops of
a 4 x 256 prefill. --attention: one layer's attention of the demo's shapes (9 / 3 heads, head_dim
64) as SDPA with the causal flag, with a mask, in float32, as matmuls with the softmax in float32,
and as the cpu backend's op over a row per query (what its extends run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def build_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    from rxf.bench.datasets import random_requests, shared_prefix_requests

    rng = random.Random(args.seed)
    if args.workload == "random":
        reqs = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, 0.0, rng)
    else:
        reqs = shared_prefix_requests(tokenizer, 4, 8, 512, 32, args.output_len, rng)
    return [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]


def replay(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rxf.core.config import load_config
    from rxf.core.ipc.messages import PreparedRequest, RequestOptions
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.sampling_params import SamplingParams
    from rxf.core.scheduler.scheduler import Scheduler
    from rxf.entrypoints.demo_model import resolve_model_path

    overrides = dict(s.split("=", 1) for s in args.set)
    if args.threads:
        overrides["runtime.cpu_threads"] = str(args.threads)
    import rxf

    demo_toml = Path(rxf.__file__).resolve().parent.parent / "examples" / "demo.toml"  # the checkout's own
    config = load_config(str(demo_toml), **overrides)
    path = resolve_model_path("demo")
    kwargs = {}
    if not config.runtime.cpu_threads:  # the scheduler process's default (of the checkout's time)
        try:
            from rxf.core.runner.cpu_threads import CpuThreads

            kwargs["threads"] = CpuThreads(os.cpu_count() or 1)
        except ImportError:
            from rxf.core.scheduler.process import default_cpu_threads

            torch.set_num_threads(default_cpu_threads())
    runner = ModelRunner(config, PluginRegistry.load(), path, **kwargs)
    backend = runner.attn_backend
    if hasattr(backend, "compiled"):
        backend.compiled.wait()
    compiled = getattr(runner, "compiled_decode", None)  # (checkouts of its time)
    if compiled is not None:
        compiled.done.wait()
    tokenizer = AutoTokenizer.from_pretrained(path)
    sched = Scheduler(config, runner, tokenizer)
    prompts = build_prompts(args, tokenizer)
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}

    # Warm-up: one short request (first-call costs are not the workload's).
    sched.add_request(PreparedRequest("warm", prompts[0][:16], SamplingParams.from_dict({**params, "max_new_tokens": 4})))
    while sched.has_work:
        sched.step()
    sched.flush_cache()

    launched = []  # the step's shape, recorded as the scheduler hands it to the runner
    launch = sched.runner.launch

    def recording_launch(batch):
        handle = launch(batch)  # (runs the forward, unless overlap is on)
        launched.append({"mode": batch.mode.name, "reqs": len(batch.reqs), "tokens": batch.num_tokens,
                         "prefix": sum(batch.prefix_lens), "sampled": sum(batch.sample),
                         "threads": torch.get_num_threads()})
        return handle

    sched.runner.launch = recording_launch
    pending = list(enumerate(prompts))
    queued_at: dict[str, float] = {}
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    steps = []
    in_flight = 0
    start = time.perf_counter()
    while pending or sched.has_work:
        while pending and in_flight < args.concurrency:
            i, ids = pending.pop(0)
            rid = f"r{i}"
            sched.add_request(PreparedRequest(rid, ids, SamplingParams.from_dict(params), RequestOptions(stream=True)))
            queued_at[rid] = time.perf_counter()
            in_flight += 1
        t0 = time.perf_counter()
        n = len(launched)
        outs = sched.step()
        now = time.perf_counter()
        for shape in launched[n:]:
            steps.append({"t": t0 - start, "dt": now - t0, "waiting": len(sched.waiting), **shape})
        for out in outs:
            if out.rid not in first and out.new_token_ids:
                first[out.rid] = now
                cached[out.rid] = out.cached_tokens
            if out.finished:
                in_flight -= 1
    duration = time.perf_counter() - start
    ttft = sorted(first[r] - queued_at[r] for r in first)
    stats = sched.stats()
    return {
        "duration_s": duration,
        "output_tok_s": len(prompts) * args.output_len / duration,
        "ttft_median_ms": 1000 * statistics.median(ttft),
        "ttft_ms": [round(1000 * t) for t in ttft],
        "cached_tokens": [cached[f"r{i}"] for i in range(len(prompts))],
        "prompt_tokens": stats.extra["prompt_tokens"],
        "computed_prompt_tokens": stats.extra["prompt_tokens"] - stats.extra["cached_tokens"],
        "torch_threads": sorted({s["threads"] for s in steps}),
        "steps": steps,
    }


FORWARDS = [(1, 256, 0), (4, 256, 0), (16, 256, 0), (4, 256, 256), (16, 256, 256), (16, 32, 512), (1, 544, 0)]


def forward_costs(args: argparse.Namespace) -> None:
    from rxf.core.forward import ForwardMode
    from rxf.core.runner.model_runner import ModelInput
    from rxf.entrypoints.demo_model import resolve_model_path
    from rxf.testing.model_harness import ModelHarness

    h = ModelHarness(resolve_model_path("demo"), "cpu", **{"model.dtype": args.dtype, "cache.max_total_tokens": 20000,
                                                           "scheduler.max_running_requests": 32})
    r = h.runner

    def run(n: int, new: int, prefix: int) -> float:
        prompts = [[(11 + 7 * i + 3 * j) % 49000 for j in range(prefix + new)] for i in range(n)]
        rows, slots = h._start(prompts)
        if prefix:
            r.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in prompts for t in p[:prefix]], [0] * n,
                                 [prefix] * n, torch.cat([s[:prefix] for s in slots])))
        start = time.perf_counter()
        r.forward(ModelInput(ForwardMode.EXTEND if prefix else ForwardMode.PREFILL, rows,
                             [t for p in prompts for t in p[prefix:]], [prefix] * n, [new] * n,
                             torch.cat([s[prefix:] for s in slots])))
        return time.perf_counter() - start

    with torch.inference_mode():
        for n, new, prefix in FORWARDS:
            best = min(run(n, new, prefix) for _ in range(3))
            print(f"{args.dtype}, {torch.get_num_threads()} threads: {n:2d} x {new:3d} new tokens over {prefix:3d}: "
                  f"{best * 1e3:7.1f} ms, {best * 1e3 / (n * new):.3f} ms per token (load average "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(4, 256, 0)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


def _median_ms(fn) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention_case(dtype: torch.dtype, b: int, new: int, keys: int) -> dict[str, float]:
    """ms of one layer's attention of the demo's shapes, each way (causal only without a prefix)."""
    import torch.nn.functional as F

    heads, kv_heads, dim = 9, 3, 64
    q = torch.randn(b, heads, new, dim, dtype=dtype)
    k, v = (torch.randn(b, kv_heads, keys, dim, dtype=dtype) for _ in range(2))
    mask = (torch.arange(keys)[None, :] <= torch.arange(keys - new, keys)[:, None]).expand(b, 1, new, keys)

    def matmuls() -> torch.Tensor:  # query heads grouped per kv head, the softmax in float32
        scores = (q.view(b, kv_heads, -1, dim) @ k.transpose(-1, -2)).float() * dim**-0.5
        scores = scores.view(b, kv_heads, heads // kv_heads, new, keys).masked_fill(~mask[:, :, None], float("-inf"))
        return scores.softmax(-1).to(dtype).view(b, kv_heads, -1, keys) @ v

    out = {}
    if new == keys:
        out["SDPA causal"] = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    out["SDPA mask"] = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    out["SDPA float32"] = _median_ms(
        lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True))
    out["matmuls"] = _median_ms(matmuls)
    # The cpu backend's op: a row per query over its request's row of a slot table, K/V in a pool.
    from rxf.plugins.attention.cpu_decode import decode_attention_op

    op = decode_attention_op()
    k_pool, v_pool = (x.transpose(1, 2).reshape(b * keys, kv_heads, dim).contiguous() for x in (k, v))
    slots = torch.arange(b * keys).view(b, keys)
    slot_rows = torch.arange(b).repeat_interleave(new)
    seq_lens = (keys - new + 1 + torch.arange(new)).repeat(b).to(torch.int32)
    q_rows = q.transpose(1, 2).reshape(b * new, heads, dim).contiguous()
    no_sinks, one = torch.full((heads,), float("-inf")), torch.ones(())
    out["op rows"] = _median_ms(lambda: op(q_rows, k_pool, v_pool, one, one, slots, slot_rows, seq_lens,
                                           seq_lens * 0, no_sinks, dim**-0.5, None))
    return out


def attention_costs(args: argparse.Namespace) -> None:
    for b, new, keys in ((4, 256, 256), (1, 544, 544), (16, 32, 544), (16, 256, 256)):
        cells = ", ".join(f"{name} {ms:.1f}" for name, ms in attention_case(getattr(torch, args.dtype), b, new, keys).items())
        print(f"{args.dtype}, {torch.get_num_threads()} threads, {b} x {new} queries over {keys} keys: ms {cells}",
              flush=True)


def print_result(res: dict, show_steps: bool) -> None:
    if show_steps:
        for s in res["steps"]:
            print(f"  t {s['t']:7.3f} s  {s['mode']:7s} {s['dt'] * 1e3:7.1f} ms  reqs {s['reqs']:2d} tokens {s['tokens']:5d} "
                  f"prefix {s['prefix']:5d} sampled {s['sampled']:2d} waiting {s['waiting']:2d} threads {s['threads']}")
    print(f"output {res['output_tok_s']:.1f} tok/s in {res['duration_s']:.1f} s; TTFT median {res['ttft_median_ms']:.0f} ms "
          f"(min {res['ttft_ms'][0]}, max {res['ttft_ms'][-1]}); prompt tokens {res['prompt_tokens']}, computed "
          f"{res['computed_prompt_tokens']}; torch threads {res['torch_threads']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["shared-prefix", "random"], default="shared-prefix")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="runtime.cpu_threads (0: the engine's default)")
    p.add_argument("--set", action="append", default=[], help="a config override, KEY=VALUE")
    p.add_argument("--steps", action="store_true", help="print every step")
    p.add_argument("--checkouts", nargs="+", help="alternate these trees, each in a fresh interpreter")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forward", action="store_true", help="time single forwards instead of a replay")
    p.add_argument("--attention", action="store_true", help="time one layer's attention variants")
    p.add_argument("--profile", action="store_true", help="with --forward: torch.profiler's top ops")
    p.add_argument("--dtype", default="bfloat16", help="--forward / --attention")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.forward or args.attention:
        torch.set_num_threads(args.threads or 1)
        forward_costs(args) if args.forward else attention_costs(args)
        return
    if not args.checkouts:
        res = replay(args)
        if args.json:
            print("RESULT " + json.dumps(res))
        else:
            print_result(res, args.steps)
        return
    forwarded = [a for a in sys.argv[1:] if a not in args.checkouts and a != "--checkouts"]
    results: dict[str, list[dict]] = {c: [] for c in args.checkouts}
    for _ in range(args.rounds):
        for checkout in args.checkouts:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), RXF_CPU_ATTENTION_COMPILE="startup")
            out = subprocess.run([sys.executable, __file__, *forwarded, "--json"], env=env, capture_output=True, text=True)
            lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if not lines:
                print(f"{checkout}: failed: {out.stderr[-600:]}", flush=True)
                continue
            res = json.loads(lines[0].removeprefix("RESULT "))
            results[checkout].append(res)
            print(f"{checkout} (load average {os.getloadavg()[0]:.2f}): ", end="")
            print_result(res, False)
    for checkout, runs in results.items():
        if runs:
            print(f"{checkout}: median over {len(runs)}: output {statistics.median(r['output_tok_s'] for r in runs):.1f} tok/s, "
                  f"TTFT median {statistics.median(r['ttft_median_ms'] for r in runs):.0f} ms")


if __name__ == "__main__":
    main()
