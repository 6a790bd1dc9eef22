"""Speculative decoding under CUDA graphs (skipped without CUDA): a verify (and a draft's catch-up
extend) replays a decode graph (`ModelRunner._extend_rows`) and gives the eager extend's logits; n-gram and draft-model speculation
(the draft's decode steps replayed from its own graphs) keep greedy tokens those of transformers.

float32 for triton, so that the two paths agree to rounding; FlashInfer runs bf16 (its kernels take
half-precision queries), where the decode and prefill kernels round differently (single logits
then differ by up to ~0.25): the bound there is on the relative difference over all logits, which
tells a right verify from a wrong one (a wrong mask moves every logit by O(1)).
"""

from __future__ import annotations

import pytest
import torch

from rxf import Runtime
from rxf.core.forward import ForwardMode
from rxf.core.runner.model_runner import ModelInput
from rxf.testing.checkpoints import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness
from rxf.testing.model_parity import runtime_config
from rxf.testing.reference import HFReference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_GPU = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 512, "num_hidden_layers": 4}
# Speculation's settings size the graphs: 4 requests x (8 drafts + 1) rows, capped by max_bs.
GPU = {"runtime.device": "cuda", "cuda_graph.max_bs": 32, "speculative.method": "ngram",
       "speculative.num_draft_tokens": 8}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec-graphs"), seed=5, **TINY_GPU)


# FlashInfer's bound: measured 2.2e-2 (verify) and 1.4e-2 (catch-up) on the H200.
@pytest.mark.parametrize(("backend", "dtype", "tol"), [("triton", "float32", 1e-4), ("flashinfer", "bfloat16", 5e-2)])
@pytest.mark.parametrize("logits_start", [[0, 0, 0], None], ids=["verify", "catch-up"])
def test_a_short_extend_replays_a_decode_graph_with_the_extends_logits(target, backend, dtype, tol, logits_start,
                                                                        monkeypatch):
    runner = ModelHarness(target, attention_backend=backend, **{**GPU, "model.dtype": dtype}).runner
    graphs = runner.cuda_graphs
    assert graphs is not None and max(graphs.sizes) == 32
    prompts = [[(11 * i + 5 * j) % 500 + 3 for j in range(40 + 23 * i)] for i in range(3)]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    with torch.inference_mode():
        runner.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in prompts for t in p], [0] * 3,
                                  [len(p) for p in prompts], runner.token_to_kv_pool.alloc(sum(map(len, prompts)))))
        new = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32]]  # 8 drafts, none, 2
        slots = runner.token_to_kv_pool.alloc(13)
        inp = ModelInput(ForwardMode.EXTEND, rows, [t for n in new for t in n], [len(p) for p in prompts],
                         [len(n) for n in new], slots, logits_start=logits_start)
        replays = []
        replay = graphs.replay
        monkeypatch.setattr(graphs, "replay", lambda *a: replays.append(a[0].padded_bs) or replay(*a))
        as_rows = runner.forward(inp).clone()
        assert replays == [16]  # 13 rows in the 16-row bucket
        monkeypatch.setattr(runner.attn_backend, "verifies_as_decode", False)
        as_extend = runner.forward(inp)
    assert replays == [16]
    if dtype == "float32":
        torch.testing.assert_close(as_rows, as_extend, rtol=tol, atol=tol)
    else:  # bf16 kernels of two kinds: their relative difference over all logits
        error = float((as_rows - as_extend).norm() / as_extend.norm())
        print(f"{backend} {dtype}: relative difference of the logits {error:.2e}")
        assert error < tol, error


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_under_graphs_keeps_greedy_tokens(target, method, tmp_path):
    # A prompt that repeats, so n-gram drafts are proposed and some accepted.
    prompts = [[5, 17, 33, 48, 17, 33, 48, 17, 33, 60, 7, 9] * 3, list(range(40, 90)), [100, 101, 102, 103] * 8]
    ref = HFReference(target)
    want = [ref.greedy(p, 32) for p in prompts]
    spec = {"method": method, "num_draft_tokens": 4, "max_batch_size": 4, "ngram_min_match": 2}
    if method == "draft":  # the target drafts for itself: every draft is accepted
        spec["draft_model_path"] = str(target)
    config = runtime_config(target, chunk=16, speculative=spec, runtime={"device": "cuda"},
                            attention={"backend": "triton"}, model={"dtype": "float32"}, cuda_graph={"max_bs": 32})
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    with Runtime.from_config(config) as rt:
        for attempt in ("first pass", "second pass (cached prefixes)"):
            outs = rt.generate(input_ids=prompts, sampling_params=params)
            assert [o["output_ids"] for o in outs] == want, attempt
        extra = rt.get_stats().extra
    # Random weights seldom continue a prompt's n-grams: n-gram's drafts may all be rejected.
    assert extra["verify_steps"] > 0 and (method == "ngram" or extra["accepted_tokens"] > 0), extra


def test_a_tree_verify_replays_a_decode_graph_with_each_nodes_path_logits(target, monkeypatch):
    """Each node on a scratch row over its path: its logits are a plain prefill's of prefix + path."""
    from rxf.core.draft_tree import draft_path

    spec = {"speculative.method": "eagle3", "speculative.draft_model_path": str(target), "speculative.tree_topk": 2}
    runner = ModelHarness(target, attention_backend="triton", **{**GPU, **spec, "model.dtype": "float32"}).runner
    drafts, parents = [7, 8, 9, 10, 11, 12], [-1, -1, 0, 0, 1, 3]
    prompt = [(13 * j) % 500 + 3 for j in range(70)]
    with torch.inference_mode():
        row = runner.req_to_token_pool.alloc()
        runner.forward(ModelInput(ForwardMode.PREFILL, [row], prompt, [0], [70], runner.token_to_kv_pool.alloc(70)))
        replays = []
        replay = runner.cuda_graphs.replay
        monkeypatch.setattr(runner.cuda_graphs, "replay", lambda *a: replays.append(a[0].padded_bs) or replay(*a))
        inp = ModelInput(ForwardMode.EXTEND, [row], [44, *drafts], [70], [7], runner.token_to_kv_pool.alloc(7),
                         logits_start=[0], tree_parents=[parents])
        logits = runner.forward(inp).clone()
        assert replays == [8]
        want = []
        for node in range(-1, len(drafts)):
            context = [*prompt, 44, *draft_path(drafts, parents, node)]
            r, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(context))
            want.append(runner.forward(ModelInput(ForwardMode.PREFILL, [r], context, [0], [len(context)], slots))[0])
            runner.req_to_token_pool.free(r)
            runner.token_to_kv_pool.free(slots)
    torch.testing.assert_close(logits, torch.stack(want), rtol=1e-4, atol=1e-4)
