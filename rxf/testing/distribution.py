"""Sampling checked against the exact distribution: what a sampler should draw, and a chi-square test."""

from __future__ import annotations

import torch


def filtered(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The sampler's distribution by definition: the top_k logits, softmax at `temperature`."""
    probs = torch.zeros_like(logits, dtype=torch.float64)
    values, ids = logits.double().topk(top_k)
    return probs.index_put_((ids,), torch.softmax(values / temperature, dim=0))


def chi_square_p(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    """The p-value of the sampled `counts` under the `exact` probabilities (every sample must lie
    in their support)."""
    n = sum(counts.values())
    assert set(counts) <= set(exact), f"sampled outside the support: {set(counts) - set(exact)}"
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())
    df = len(exact) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def exact_prefixes(logits_of, prompt: list[int], length: int, temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every sequence of `length` tokens after `prompt`, from
    `logits_of(tokens)` (the next token's logits after them)."""
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for seq, p in exact.items():
            probs = filtered(logits_of(prompt + list(seq)), temperature, top_k)
            for t in probs.nonzero().flatten().tolist():
                grown[(*seq, t)] = p * float(probs[t])
        exact = grown
    return exact


def prefix_counts(outputs: list[list[int]], length: int) -> dict[tuple[int, ...], int]:
    """How often each sequence of the first `length` tokens occurs among `outputs`."""
    counts: dict[tuple[int, ...], int] = {}
    for ids in outputs:
        key = tuple(ids[:length])
        counts[key] = counts.get(key, 0) + 1
    return counts
