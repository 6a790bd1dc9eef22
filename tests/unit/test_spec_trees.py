"""Tree drafts: which tokens a tree verify emits (`accept.accepted_path`), how a proposer's tree is
cut to its budget (`eagle_tree._best_tree`), and the verify forward itself: every node's logits are
those of the request's prefix followed by the node's path, computed as a plain extend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rxf.core.draft_tree import draft_path
from rxf.core.forward import ForwardMode
from rxf.core.runner.model_runner import ModelInput
from rxf.core.speculative.accept import accepted_path, first_chain, row_depths
from rxf.core.speculative.eagle_tree import _best_tree
from rxf.plugins.attention.cpu import COMPILE_ENV
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness

#        newest
#       /      \
#     7 (0)    8 (1)
#    /    \       \
#  9 (2)  10 (3)  11 (4)
#           |
#         12 (5)
DRAFTS, PARENTS = [7, 8, 9, 10, 11, 12], [-1, -1, 0, 0, 1, 3]


def test_a_tree_verify_follows_the_samples_down_the_tree():
    # Rows: 0 after the newest token, 1 + j after draft j's path.
    assert accepted_path(DRAFTS, PARENTS, [7, 10, 99, 99, 99, 99, 99]) == ([7, 10, 99], [0, 3])
    assert accepted_path(DRAFTS, PARENTS, [7, 10, 99, 99, 12, 99, 5]) == ([7, 10, 12, 5], [0, 3, 5])
    assert accepted_path(DRAFTS, PARENTS, [8, 99, 11, 99, 99, 42, 99]) == ([8, 11, 42], [1, 4])
    assert accepted_path(DRAFTS, PARENTS, [3, 9, 9, 9, 9, 9, 9]) == ([3], [])
    chain = [4, 5, 6]
    assert accepted_path(chain, [-1, 0, 1], [4, 5, 1, 2]) == ([4, 5, 1], [0, 1])
    with pytest.raises(ValueError, match="samples"):
        accepted_path(DRAFTS, PARENTS, [1, 2])


def test_tree_paths_depths_and_first_chain():
    assert draft_path(DRAFTS, PARENTS, 5) == [7, 10, 12] and draft_path(DRAFTS, PARENTS, -1) == []
    assert row_depths(PARENTS, 6) == [0, 1, 1, 2, 2, 2, 3] and row_depths(None, 2) == [0, 1, 2]
    assert first_chain(DRAFTS, PARENTS) == [7, 9]


def test_the_best_nodes_form_a_tree_listed_level_by_level():
    #            scores: a node's path log-probability (children never above their parent)
    tokens = [10, 11, 12, 13, 14, 15]
    scores = [-0.1, -0.5, -0.3, -0.9, -0.3, -2.0]
    parent = [-1, -1, 0, 0, 2, 1]
    drafts, parents = _best_tree(tokens, scores, parent, 4)
    # The four best: 10 (-0.1), 12 (-0.3, child of 10), 14 (-0.3, child of 12), 11 (-0.5).
    assert drafts == [10, 11, 12, 14] and parents == [-1, -1, 0, 2]
    # A tie between a node and its child keeps the parent first.
    assert _best_tree([1, 2], [0.0, 0.0], [-1, 0], 1) == ([1], [-1])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tree-verify"))


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_a_tree_verify_gives_each_node_its_paths_logits(ckpt: Path, backend: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(COMPILE_ENV, "startup")
    spec = {"speculative.method": "eagle3", "speculative.draft_model_path": str(ckpt), "speculative.tree_topk": 2,
            "speculative.num_draft_tokens": 6}
    runner = ModelHarness(ckpt, attention_backend=backend, **spec).runner
    assert len(runner.req_to_token_pool.scratch_rows) == 4 * 6  # max_batch_size x num_draft_tokens
    prompts = [[5, 80, 17, 9, 33, 2, 41], list(range(100, 120))]
    newest = [44, 45]
    with torch.inference_mode():
        rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        runner.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in prompts for t in p], [0, 0],
                                  [len(p) for p in prompts], runner.token_to_kv_pool.alloc(27)))
        trees = [(DRAFTS, PARENTS), ([50, 51], [-1, 0])]  # a tree and a chain
        ids = [t for (d, _), n in zip(trees, newest, strict=True) for t in [n, *d]]
        slots = runner.token_to_kv_pool.alloc(10)
        inp = ModelInput(ForwardMode.EXTEND, rows, ids, [7, 20], [7, 3], slots, logits_start=[0, 0],
                         tree_parents=[PARENTS, None])
        logits = runner.forward(inp)
        assert logits.shape == (10, runner.vocab_size)
        # The chain stays on its request's row (the scheduler keeps its slots at their positions
        # without rewriting them); the tree's drafts went to scratch rows, its row holds the newest.
        table = runner.req_to_token_pool.req_to_token
        assert table[rows[1], 20:23].tolist() == slots[7:10].tolist() and table[rows[0], 7].item() == slots[0].item()
        # The reference: each row's context as one plain prefill of a fresh request.
        want = []
        for p, n, (drafts, parents) in zip(prompts, newest, trees, strict=True):
            for node in range(-1, len(drafts)):
                context = [*p, n, *draft_path(drafts, parents, node)]
                row, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(context))
                want.append(runner.forward(ModelInput(ForwardMode.PREFILL, [row], context, [0], [len(context)], slots))[0])
                runner.req_to_token_pool.free(row)
                runner.token_to_kv_pool.free(slots)
    torch.testing.assert_close(logits, torch.stack(want), rtol=1e-4, atol=1e-4)
