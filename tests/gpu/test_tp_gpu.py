"""Tensor parallelism over NCCL on two GPUs (skipped with fewer): tp 2 against tp 1 on tiny random
Llama and Mixtral checkpoints in float32 (same tokens, logits within fp32 tolerance), and a tp-2
Runtime with CUDA graphs generating what the tp-1 one does."""

from __future__ import annotations

import os

import pytest
import torch

from rxf import Runtime
from rxf.testing import make_tiny_checkpoint
from rxf.testing.parallel import generate_each, run_tp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
PROMPTS = [[5, 80, 17, 300, 42, 9, 250, 11, 64, 3, 77], [400, 12], [99, 100, 101, 102, 103, 104]]
ARCHS = {"llama": ("LlamaForCausalLM", {}),
         "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2})}


def _config(path, backend: str, **extra) -> dict:
    return {"model": {"path": str(path), "dtype": "float32"}, "runtime": {"device": "cuda"},
            "attention": {"backend": backend}, "cache": {"max_total_tokens": 2048},
            "scheduler": {"max_running_requests": 8}, **extra}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return [make_tiny_checkpoint(tmp_path_factory.mktemp(n), arch, seed=3, **kw) for n, (arch, kw) in ARCHS.items()]


def test_tp2_matches_tp1_on_nccl(checkpoints):
    jobs = [(_config(path, "torch_native"), str(path), PROMPTS, 32) for path in checkpoints]
    (ref,) = run_tp(generate_each, 1, (jobs,), device="cuda")
    ranks = run_tp(generate_each, 2, (jobs,), device="cuda")
    for i in range(len(jobs)):
        ref_tokens, ref_logits = ref[i]
        for rank in ranks:
            tokens, logits = rank[i]
            assert tokens == ref_tokens
            for ours, want in zip(logits, ref_logits, strict=True):
                torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_tp2_runtime_with_cuda_graphs(checkpoints):
    config = _config(checkpoints[0], "triton")
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = [{"input_ids": p} for p in PROMPTS]
    with Runtime.from_config(config) as rt:
        want = [rt.generate(input_ids=p["input_ids"], sampling_params=params)["output_ids"] for p in prompts]
    with Runtime.from_config(config, **{"parallel.tp_size": 2}) as rt:
        got = [rt.generate(input_ids=p["input_ids"], sampling_params=params)["output_ids"] for p in prompts]
    assert got == want
