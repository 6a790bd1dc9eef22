"""Which draft tokens a verify forward accepts.

The runner samples every verified position i (0..k) of a request with the request's own sampler,
exactly as a decode step would sample it after the prefix `drafts[:i]`: penalties over that
history, the min_new_tokens ban of that output index, the grammar mask after `drafts[:i]`,
temperature, top-k / top-p / min-p, and a fresh draw. The accepted tokens are the samples up to and
including the first one that differs from its draft (all k + 1 when every draft matches: the last
is the bonus token).

Why this keeps the output distribution exactly the target's. Write p_i for the target's final
distribution at position i (after every filter). Standard speculative sampling (Leviathan et al.
2023; Chen et al. 2023) accepts a draft x drawn from a draft distribution q with probability
min(1, p(x) / q(x)), and on rejection draws from the residual max(0, p - q) renormalised. An n-gram
draft is deterministic: q is one-hot on the draft token d, so it accepts d with probability p(d)
and on rejection draws from p with d removed, renormalised. Drawing y ~ p and accepting iff y == d
is the same procedure: P(y = d) = p(d), and given y != d, y is distributed as p(x) / (1 - p(d)) for
x != d, the residual. So the emitted token at position i is distributed as p_i, and position i + 1
is only used when the emitted token equals d_i, i.e. when the prefix it was computed for is the
real one. Each position draws fresh noise, independent of the others. Greedy decoding is the
deterministic case: the sample is the argmax, and the longest prefix of drafts equal to the argmax
is accepted, plus the argmax after it.

Trees (`parents[j]`: draft j's parent, -1 for the newest token; parents come first). Row 0 is
sampled after the newest token, row 1 + j after draft j's path (its ancestors, then j). From the
newest token, the sample of the current node's row is emitted; if a child of the node holds it, that
child becomes current and its row is read next, else the step ends. The children are a
deterministic function of the context, so the same argument holds: each emitted token is a fresh
draw from p at the real context, and a child's row is read only when the emitted token is the
child's, i.e. when the context it was computed for is the real one. A chain is the tree whose
draft j has parent j - 1.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verify step emits: `sampled` (len(drafts) + 1 samples, position i sampled after
    `drafts[:i]`) up to and including its first disagreement with `drafts`."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} samples for {len(drafts)} drafts (need one more)")
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[: i + 1]
    return list(sampled)


def accepted_path(drafts: list[int], parents: list[int], sampled: list[int]) -> tuple[list[int], list[int]]:
    """What a tree verify emits: (tokens, the drafts they took: one fewer). `sampled[0]` follows the
    newest token, `sampled[1 + j]` draft j's path."""
    if len(sampled) != len(drafts) + 1 or len(parents) != len(drafts):
        raise ValueError(f"{len(sampled)} samples and {len(parents)} parents for {len(drafts)} drafts")
    children: dict[int, dict[int, int]] = {}
    for j, (token, parent) in enumerate(zip(drafts, parents, strict=True)):
        children.setdefault(parent, {}).setdefault(token, j)
    tokens, nodes, node = [], [], -1
    while True:
        token = sampled[node + 1]
        tokens.append(token)
        child = children.get(node, {}).get(token)
        if child is None:
            return tokens, nodes
        nodes.append(child)
        node = child


def row_depths(parents: list[int] | None, num_drafts: int) -> list[int]:
    """Per sampled row (the newest token's, then each draft's), how many drafts precede its sample."""
    if parents is None:
        return list(range(num_drafts + 1))
    depths = [0]
    for parent in parents:
        depths.append(depths[parent + 1] + 1)
    return depths


def first_chain(drafts: list[int], parents: list[int]) -> list[int]:
    """The tree's chain of first children from the newest token (a proposer lists the likelier
    child first)."""
    first: dict[int, int] = {}
    for j, parent in enumerate(parents):
        first.setdefault(parent, j)
    chain, node = [], first.get(-1)
    while node is not None:
        chain.append(drafts[node])
        node = first.get(node)
    return chain
