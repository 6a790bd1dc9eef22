"""CPU attention backends side by side on the demo model, in one process (issue 22).

    RXF_CPU_ATTENTION_COMPILE=startup python benchmarks/bench_cpu_attention.py \
        [--dtype bfloat16] [--batch 1 4 16] [--context 160] [--threads N]
    python benchmarks/bench_cpu_attention.py --kernels   # decode attention alone, the options measured

Model mode: one `ModelHarness` per backend (same checkpoint, same prompts); per batch size, two
PREFILLs of `--context`-token prompts each (the faster counts), then DECODE steps alternating between
the backends, so a change in the machine's load hits all alike. Reports the median step and the
ratio to the first backend.

Kernel mode: decode attention for the demo model's shapes (9 / 3 heads, head_dim 64) over random
scattered slots: index_select gather + SDPA with a mask (torch_native's way), gather + batched matmuls
in float32, and the cpu backend's C++ op (`rxf/plugins/attention/cpu_decode.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median seconds of `fn` over `repeats` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_case(dtype: torch.dtype, bs: int, length: int) -> None:
    """One batch of the demo model's decode attention shapes, each way; prints their times."""
    from rxf.plugins.attention.cpu_decode import decode_attention_op

    op = decode_attention_op()

    heads, kv_heads, head_dim, num_slots = 9, 3, 64, 16384
    k_buf, v_buf = (torch.randn(num_slots, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    seq_lens = torch.randint(length // 2, length + 1, (bs,), dtype=torch.int32)
    seq_lens[0] = length
    valid = torch.arange(length)[None] < seq_lens[:, None]
    slots = torch.where(valid, torch.randperm(num_slots - 1)[: bs * length].view(bs, length) + 1, 0)
    q = torch.randn(bs, heads, head_dim, dtype=dtype)
    scale, no_sinks, one = head_dim**-0.5, torch.full((heads,), float("-inf")), torch.ones(())

    def gathered() -> tuple[torch.Tensor, torch.Tensor]:
        flat, shape = slots.reshape(-1), (bs, length, kv_heads, head_dim)
        return k_buf.index_select(0, flat).view(shape), v_buf.index_select(0, flat).view(shape)

    def sdpa() -> torch.Tensor:
        k, v = gathered()
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None, :],
            scale=scale, enable_gqa=True,
        ).squeeze(2)

    def matmuls() -> torch.Tensor:
        k, v = gathered()
        scores = (q.view(bs, kv_heads, -1, head_dim).float() @ k.permute(0, 2, 3, 1).float()) * scale
        probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
        return (probs @ v.transpose(1, 2).float()).view(bs, heads, head_dim).to(dtype)

    def cpu_op() -> torch.Tensor:
        return op(q, k_buf, v_buf, one, one, slots, torch.arange(bs), seq_lens, seq_lens * 0, no_sinks, scale, None)

    ref = sdpa().float()
    for name, fn in (("gather + SDPA with mask", sdpa), ("gather + fp32 matmuls", matmuls), ("C++ op (cpu)", cpu_op)):
        err = (fn().float() - ref).abs().max().item()
        print(f"{str(dtype).removeprefix('torch.'):8s} bs {bs:2d} keys {length:3d}  {name:24s} "
              f"{timed(fn) * 1e6:7.0f} us  max diff {err:.1e}", flush=True)


def kernels(args: argparse.Namespace) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for bs, length in ((1, 160), (16, 160), (16, 600)):
            decode_case(dtype, bs, length)


def model(args: argparse.Namespace) -> None:
    from rxf.core.forward import ForwardMode
    from rxf.core.runner.model_runner import ModelInput
    from rxf.entrypoints.demo_model import resolve_model_path
    from rxf.testing.model_harness import ModelHarness

    settings = {"model.dtype": args.dtype, "scheduler.max_running_requests": max(args.batch), "cache.max_total_tokens": 32768}
    harnesses = {name: ModelHarness(resolve_model_path("demo"), name, **settings) for name in args.backends}
    with torch.inference_mode():
        for bs in args.batch:
            prompts = [[(11 + 7 * i + 3 * j) % 49000 for j in range(args.context)] for i in range(bs)]
            prefill: dict[str, list[float]] = {name: [] for name in harnesses}
            state = {}
            for _ in range(2):
                for name, h in harnesses.items():
                    rows, slots = h._start(prompts)
                    start = time.perf_counter()
                    h._prefill(prompts, rows, slots, all_logits=False)
                    prefill[name].append(time.perf_counter() - start)
                    state[name] = (rows, [args.context] * bs)
            steps: dict[str, list[float]] = {name: [] for name in harnesses}
            for step in range(args.steps + 2):
                for name, h in harnesses.items():
                    rows, lens = state[name]
                    new = h.runner.token_to_kv_pool.alloc(bs)
                    start = time.perf_counter()
                    h.runner.forward(ModelInput(ForwardMode.DECODE, rows, [5] * bs, list(lens), [1] * bs, new))
                    if step >= 2:  # the first steps of a batch size may still compile
                        steps[name].append(time.perf_counter() - start)
                    state[name] = (rows, [n + 1 for n in lens])
            base = args.backends[0]
            for name in harnesses:
                step_s, pre_s = statistics.median(steps[name]), min(prefill[name])
                print(f"{args.dtype} bs {bs:2d} context {args.context} {name:12s} decode {step_s * 1e3:6.1f} ms/step "
                      f"({bs / step_s:6.1f} tok/s, x{statistics.median(steps[base]) / step_s:.2f})  prefill "
                      f"{pre_s * 1e3:6.0f} ms (x{min(prefill[base]) / pre_s:.2f})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", action="store_true", help="decode attention alone, not the model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", nargs="+", default=["torch_native", "cpu"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    kernels(args) if args.kernels else model(args)


if __name__ == "__main__":
    main()
