"""Draft trees as the scheduler and the runner exchange them: per request, its drafts' tokens in
order and `parents[j]`, draft j's parent (-1: the request's newest token), each parent before its
children. A chain is the tree whose draft j has parent j - 1 (`rxf.core.speculative.accept` says
how a verify walks one)."""

from __future__ import annotations


def draft_path(drafts: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the first draft on to `node` along the tree (-1: the newest token: [])."""
    path: list[int] = []
    while node >= 0:
        path.append(drafts[node])
        node = parents[node]
    return path[::-1]
