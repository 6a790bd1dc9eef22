"""Run a function on every rank of a local tensor-parallel group, and drive a ModelRunner greedily.

`run_tp(fn, tp_size, args)` spawns `tp_size` fresh processes (torch.multiprocessing, spawn), joins
them into one process group (gloo on CPU, NCCL on CUDA) through `init_tensor_parallel`, calls
`fn(*args)` on each and returns the per-rank results in rank order. `fn` must be importable
(module level) and its result picklable; tensors should be returned on the CPU.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from rxf.core.forward import ForwardMode
from rxf.core.runner.distributed import destroy_tensor_parallel, init_tensor_parallel
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.core.runner.placement import RankPlacement, free_port


def _worker(rank: int, tp_size: int, port: int, device: str, threads: int, fn: Any, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(threads)
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(rank)
        placement = RankPlacement(0, tp_size, 1, 0, rank, f"tcp://127.0.0.1:{port}", backend)
        init_tensor_parallel(placement, timeout_s=300)
        try:
            # Plain pickle copies tensors into the message; the queue's own pickler would share
            # memory that vanishes when this process exits.
            results.put((rank, pickle.dumps(fn(*args)), None))
        finally:
            destroy_tensor_parallel()
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def run_tp(fn: Any, tp_size: int, args: tuple = (), *, device: str = "cpu", threads: int = 1) -> list[Any]:
    """`fn(*args)` on each of `tp_size` ranks; the results in rank order (raises if a rank failed)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, tp_size, port, device, threads, fn, args, results), daemon=True)
        for r in range(tp_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    for _ in procs:
        rank, value, error = results.get()
        if error is not None:
            errors.append(f"rank {rank}:\n{error}")
        out[rank] = None if value is None else pickle.loads(value)
    for p in procs:
        p.join(timeout=30)
    if errors:
        raise RuntimeError("tensor-parallel workers failed:\n" + "\n".join(errors))
    return [out[r] for r in range(tp_size)]


def greedy_generate(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill the batch, then decode greedily for `new_tokens` tokens per prompt (no stopping).

    Returns the generated ids and the logits of every step on the CPU: first the prefill's (every
    prompt position), then one `[batch, vocab]` tensor per decode step.
    """
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    slots = runner.token_to_kv_pool.alloc(sum(lens))
    assert slots is not None and None not in rows, "the KV pool is too small for the batch"
    logits = runner.forward(
        ModelInput(
            ForwardMode.PREFILL,
            rows,
            [t for p in prompts for t in p],
            [0] * len(prompts),
            lens,
            slots,
            logits_start=[0] * len(prompts),
        )
    )
    steps = [logits.cpu()]
    last_rows = torch.tensor(lens).cumsum(0) - 1
    next_ids = logits[last_rows.to(logits.device)].argmax(-1).tolist()
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens - 1):
        for seq, token in zip(out, next_ids, strict=True):
            seq.append(token)
        new = runner.token_to_kv_pool.alloc(len(prompts))
        assert new is not None, "the KV pool is too small for the batch"
        logits = runner.forward(ModelInput(ForwardMode.DECODE, rows, next_ids, list(lens), [1] * len(prompts), new))
        lens = [n + 1 for n in lens]
        steps.append(logits.cpu())
        next_ids = logits.argmax(-1).tolist()
    for seq, token in zip(out, next_ids, strict=True):
        seq.append(token)
    return out, steps


def load_and_generate(
    config: dict[str, Any], model_path: str, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Build a ModelRunner from a config dict on this rank and run `greedy_generate` (a `run_tp` target)."""
    from rxf.core.config import load_config
    from rxf.core.registry import PluginRegistry

    runner = ModelRunner(load_config(config), PluginRegistry.load(None, []), model_path)
    return greedy_generate(runner, prompts, new_tokens)


def generate_each(jobs: list[tuple[dict[str, Any], str, list[list[int]], int]]) -> list[Any]:
    """`load_and_generate(*job)` for each job in turn: one group start-up for several models."""
    return [load_and_generate(*job) for job in jobs]
