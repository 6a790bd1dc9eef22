"""Chain drafts made on the device, one forward per position, read back in one copy."""

from __future__ import annotations

import torch

# (the requests drafted in a step, by index; their draft tokens of that step, a device tensor)
ChainStep = tuple[list[int], torch.Tensor]


def read_drafts(steps: list[ChainStep], num_requests: int) -> list[list[int]]:
    """Each request's drafts in order, from every step's device tokens in one device-to-host copy."""
    drafts: list[list[int]] = [[] for _ in range(num_requests)]
    flat = torch.cat([tokens for _, tokens in steps]).tolist()
    k = 0
    for owners, _ in steps:
        for i in owners:
            drafts[i].append(int(flat[k]))
            k += 1
    return drafts
