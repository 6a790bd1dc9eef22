"""EAGLE-3 speculation on the GPU (skipped without CUDA), in float32 so that greedy choices are exact:
a batch larger than `speculative.max_batch_size` first decodes plainly, through CUDA graphs (which
capture the target's auxiliary hidden states too) and with overlap (the head absorbs a step's
states after the next step was launched), then speculates as requests finish. Every proposal must be
the reference's chain (`rxf.testing.eagle3_reference`, on the CPU) and every output transformers'.
"""

from __future__ import annotations

import pytest
import torch

from rxf.core.config import load_config
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.sampling_params import SamplingParams
from rxf.testing.checkpoints import make_tiny_checkpoint, make_tiny_eagle3_head
from rxf.testing.eagle3_reference import (
    Eagle3Reference,
    check_proposals,
    check_tree_proposals,
    recording_scheduler,
)
from rxf.testing.reference import HFReference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_GPU = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 512, "num_hidden_layers": 4}
AUX_IDS = [1, 2, 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("eagle-gpu-target"), seed=3, **TINY_GPU)
    head = make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle-gpu-head"), target, seed=4, std=0.1,
                                 eagle_aux_hidden_state_layer_ids=AUX_IDS)
    return target, head


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("tree", [None, {"tree_topk": 2, "tree_depth": 3, "num_draft_tokens": 6}], ids=["chain", "tree"])
def test_eagle3_drafts_and_outputs_on_the_gpu(models, backend, tree):
    target, head = models
    config = load_config({
        "model": {"path": str(target), "dtype": "float32"},
        "runtime": {"device": "cuda"},
        "attention": {"backend": backend},
        "cache": {"max_total_tokens": 4096},
        "scheduler": {"overlap": True, "chunked_prefill_size": 16, "max_running_requests": 8},
        "cuda_graph": {"max_bs": 8},
        "speculative": {"method": "eagle3", "draft_model_path": str(head), "num_draft_tokens": 4, "max_batch_size": 2,
                        **(tree or {})},
    })
    sched, proposals = recording_scheduler(config)
    # Plain decode steps replay graphs where the backend can be captured (torch_native cannot).
    assert (sched.runner.cuda_graphs is not None) == sched.runner.attn_backend.supports_cuda_graph
    # So do the head's drafting steps (its rows' features copied into the graphs' static buffer).
    head_graphs = sched.spec.draft.runner.cuda_graphs
    assert (head_graphs is not None) == sched.runner.attn_backend.supports_cuda_graph
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(9 + 6 * i)] for i in range(6)]
    lengths = [8 + 4 * i for i in range(6)]  # requests finish at different steps: the batch shrinks
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        sched.add_request(PreparedRequest(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    while sched.has_work:
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    hf = HFReference(target)
    assert [got[f"r{i}"] for i in range(6)] == [hf.greedy(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert len(proposals) > 10 and sched.stats().extra["verify_steps"] > 0
    reference = Eagle3Reference(head, target, AUX_IDS)
    chains = [p for p in proposals if len(p) == 2]  # (steps a prefill chunk may join draft chains)
    check_proposals(reference, chains, tie=1e-3)
    if tree:
        trees = [p for p in proposals if len(p) == 3]
        assert trees
        check_tree_proposals(reference, trees, tree["tree_topk"], tie=1e-3)
