"""Torch thread count and OpenMP wait policy against a busy machine, demo model decode (issue 22).

    python benchmarks/bench_cpu_threads.py [--load none|spin|torch] [--batch 1] [--rounds 3] \
        [--configs 1:default 2:default 2:PASSIVE]

Each config (threads:OMP_WAIT_POLICY, `default` = unset, `spinN` = GOMP_SPINCOUNT=N) runs in a fresh interpreter (the policy is
read when OpenMP starts), in turn, `--rounds` times: a PREFILL of `--batch` 64-token prompts, then
`--steps` timed DECODE steps through `ModelRunner` (cpu backend, compiled at start-up). `--load`
starts a background load for the whole run: `spin`, a pure-Python loop on one core; `torch`, a
second process multiplying matrices on all cores. Prints decode tok/s and the process's CPU time
over wall time per run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

LOADS = {
    "spin": "while True:\n    pass",
    "torch": "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a",
}


def child(threads: int, bs: int, steps: int, dtype: str) -> None:
    import torch

    from rxf.core.forward import ForwardMode
    from rxf.core.runner.model_runner import ModelInput
    from rxf.entrypoints.demo_model import resolve_model_path
    from rxf.testing.model_harness import ModelHarness

    torch.set_num_threads(threads)
    settings = {"model.dtype": dtype, "cache.max_total_tokens": 8192, "scheduler.max_running_requests": max(bs, 8)}
    h = ModelHarness(resolve_model_path("demo"), "cpu", **settings)
    runner = h.runner
    prompts = [[(11 + 7 * i + 3 * j) % 49000 for j in range(64)] for i in range(bs)]
    with torch.inference_mode():
        rows, slots = h._start(prompts)
        h._prefill(prompts, rows, slots, all_logits=False)
        lens = [64] * bs

        def step() -> None:
            nonlocal lens
            new = runner.token_to_kv_pool.alloc(bs)
            runner.forward(ModelInput(ForwardMode.DECODE, rows, [5] * bs, list(lens), [1] * bs, new))
            lens = [n + 1 for n in lens]

        for _ in range(3):
            step()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"RESULT {bs * steps / wall:.1f} tok/s, cpu/wall {cpu / wall:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", choices=["none", *LOADS], default="none")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", nargs="+", default=["1:default", "2:default", "2:PASSIVE"])
    p.add_argument("--child", nargs=4, metavar=("THREADS", "BATCH", "STEPS", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        threads, bs, steps, dtype = args.child
        child(int(threads), int(bs), int(steps), dtype)
        return
    load = None if args.load == "none" else subprocess.Popen([sys.executable, "-c", LOADS[args.load]])
    try:
        for _ in range(args.rounds):
            for config in args.configs:
                threads, policy = config.split(":")
                env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
                env["RXF_CPU_ATTENTION_COMPILE"] = "startup"
                if policy.startswith("spin"):  # libgomp: spin this many times, then sleep
                    env["GOMP_SPINCOUNT"] = policy.removeprefix("spin")
                elif policy != "default":
                    env["OMP_WAIT_POLICY"] = policy
                cmd = [sys.executable, __file__, "--child", threads, str(args.batch), str(args.steps), args.dtype]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
                result = lines[0].removeprefix("RESULT ") if lines else f"failed: {out.stderr[-300:]}"
                print(f"load {args.load}, batch {args.batch}, {threads} threads, wait {policy}: {result} "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        if load is not None:
            load.kill()
            load.wait()


if __name__ == "__main__":
    main()
