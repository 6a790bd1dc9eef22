"""EAGLE-3 tree drafts (`speculative.tree_topk` > 1): EAGLE-2's dynamic tree, grown by the head.

Every node has a score, the log-probability of its path under the head (the sum of its tokens'
log-probabilities over the draft vocabulary). Level 1 is the head's top `topk` tokens after the
request's newest token (kept by the absorb, `EagleState.top_tokens`). Then, `depth - 1` times, the
frontier (the `topk` best nodes of the last level) is expanded in one head forward: each frontier
node is a DECODE row at position length + level - 1 fed its token and its parent's feature (the
root's for level 1), attending to the head's entries of the request's positions and of its own
ancestors through a scratch row of req_to_token (`ModelRunner.path_rows`; its K/V goes to a slot
lent for the call, as a chain's does); its `topk` likeliest next tokens become its children. Of all
the nodes made, the `budget` best by score are drafted (a child scores at most its parent, so they
form a tree; ties keep the shallower node), listed level by level, the likelier first, so each
node's first child is its likeliest (`accept.first_chain`).

Drafts are deterministic in the context, so the target's verification stays exact
(`accept.accepted_path`). Each level reads its frontier back to the host (one small copy: the
paths of the next level's scratch rows); tokens and parents come back in one copy at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rxf.core.forward import ForwardMode

if TYPE_CHECKING:
    from rxf.core.scheduler.req import Req
    from rxf.core.speculative.eagle import Eagle3Drafter


def draft_trees(
    drafter: Eagle3Drafter, reqs: list[Req], budgets: list[int], topk: int, depth: int
) -> tuple[list[list[int]], list[list[int] | None]]:
    from rxf.core.runner.model_runner import ModelInput, PendingTokens
    from rxf.core.speculative.eagle import _current

    drafts: list[list[int]] = [[] for _ in reqs]
    parents: list[list[int] | None] = [None] * len(reqs)
    live = [i for i, (r, b) in enumerate(zip(reqs, budgets, strict=True)) if b > 0 and _current(r)]
    if not live:
        return drafts, parents
    states = [reqs[i].eagle for i in live]
    assert all(s is not None and s.top_tokens is not None for s in states), "absorbed without tree_topk"
    n, k = len(live), topk
    levels = depth if max(budgets[i] for i in live) > 1 else 1
    tokens = [torch.stack([s.top_tokens for s in states])]  # per level [n, m] target ids
    scores = [torch.stack([s.top_logprobs for s in states]).float()]
    node_parent: list[list[int]] = [[-1] * k for _ in range(n)]  # per request, per node: its parent
    frontier = [list(range(k)) for _ in range(n)]  # node ids
    paths: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(n)]  # their ancestors' head slots
    feature = torch.stack([s.feature for s in states]).repeat_interleave(k, dim=0)  # [n * k, hidden]
    f_tokens, f_scores = tokens[0], scores[0]
    lent = drafter.free_list.alloc(n * k * (levels - 1)) if levels > 1 else torch.empty(0, dtype=torch.int64)
    if lent is None:  # too few free slots: level 1 only
        levels, lent = 1, torch.empty(0, dtype=torch.int64)
    runner = drafter.runner
    try:
        own = lent.view(max(levels - 1, 0), n, k).tolist() if levels > 1 else []
        for level in range(1, levels):
            slots = own[level - 1]
            src = [reqs[live[r]].kv.row for r in range(n) for _ in range(k)]
            starts = [states[r].length for r in range(n) for _ in range(k)]
            rows = runner.path_rows(src, starts, [paths[r][f] + [slots[r][f]] for r in range(n) for f in range(k)])
            inp = ModelInput(
                mode=ForwardMode.DECODE,
                req_pool_indices=rows,
                input_ids=[0] * (n * k),  # the frontier's tokens, patched in on the device
                prefix_lens=[states[r].length + level - 1 for r in range(n) for _ in range(k)],
                extend_lens=[1] * (n * k),
                out_cache_loc=torch.tensor([s for row in slots for s in row], dtype=torch.int64),
                pending=PendingTokens(list(range(n * k)), list(range(n * k)), f_tokens.reshape(-1)),
                hidden=feature,
            )
            logits, features = runner.forward_with_aux(inp)
            assert features is not None
            child_logprobs, child_ids = logits.float().log_softmax(dim=-1).topk(k, dim=-1)  # [n * k, k]
            child_tokens = drafter.head.to_target_ids(child_ids).view(n, k * k)
            child_scores = (f_scores.unsqueeze(-1) + child_logprobs.view(n, k, k)).view(n, k * k)
            base = sum(t.shape[1] for t in tokens)
            tokens.append(child_tokens)
            scores.append(child_scores)
            for r in range(n):
                node_parent[r] += [frontier[r][f] for f in range(k) for _ in range(k)]
            f_scores, picked = child_scores.topk(k, dim=-1)  # the next frontier: the k best children
            f_tokens = child_tokens.gather(1, picked)
            by = torch.div(picked, k, rounding_mode="floor")  # each one's parent, as a frontier index
            feature = features.view(n, k, -1).gather(1, by.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
            feature = feature.reshape(n * k, -1)
            picks = picked.tolist()  # the level's one host read
            paths = [[paths[r][x // k] + [slots[r][x // k]] for x in picks[r]] for r in range(n)]
            frontier = [[base + x for x in picks[r]] for r in range(n)]
    finally:
        drafter.free_list.free(lent)
    all_tokens, all_scores = torch.cat(tokens, dim=1), torch.cat(scores, dim=1)
    flat = torch.cat([all_tokens.double(), all_scores.double()], dim=1).tolist()  # the one final copy
    m = all_tokens.shape[1]
    for r, i in enumerate(live):
        node_tokens, node_scores = flat[r][:m], flat[r][m:]
        drafts[i], parents[i] = _best_tree(node_tokens, node_scores, node_parent[r], budgets[i])
    return drafts, parents


def _best_tree(tokens: list[float], scores: list[float], parent: list[int], budget: int) -> tuple[list[int], list[int]]:
    """The `budget` best nodes (by score, the shallower first on ties) whose ancestors are all in,
    level by level and likelier first; their tokens and parents (indices into the result)."""
    depth = [0] * len(parent)
    for j, p in enumerate(parent):  # parents are made before their children
        depth[j] = 1 if p < 0 else depth[p] + 1
    chosen: set[int] = set()
    for j in sorted(range(len(parent)), key=lambda j: (-scores[j], depth[j], j)):
        if len(chosen) == budget:
            break
        if parent[j] < 0 or parent[j] in chosen:
            chosen.add(j)
    order = sorted(chosen, key=lambda j: (depth[j], -scores[j], j))
    index = {j: x for x, j in enumerate(order)}
    return [int(tokens[j]) for j in order], [index[parent[j]] if parent[j] >= 0 else -1 for j in order]
