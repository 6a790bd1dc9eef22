"""Tensor-parallel group access for model code: the seam between layers and torch.distributed.

Model code asks `tp_size()` / `tp_rank()` when it is built and calls `tp_all_reduce` /
`tp_all_gather` in forward. Until a scheduler process calls `set_tp_group`, rxf runs one rank:
size 1, rank 0, and both collectives return their input unchanged (no torch.distributed needed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None) -> None:
    """Install the tensor-parallel process group of this process (None: back to one rank)."""
    global _group
    _group = group


def tp_group() -> dist.ProcessGroup | None:
    return _group


def tp_size() -> int:
    return 1 if _group is None else dist.get_world_size(_group)


def tp_rank() -> int:
    return 0 if _group is None else dist.get_rank(_group)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the tensor-parallel ranks (in place when there is more than one)."""
    if _group is None or tp_size() == 1:
        return x
    dist.all_reduce(x, group=_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenation of every rank's `x` along `dim`, in rank order."""
    if _group is None or tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_group)
    return torch.cat(parts, dim=dim)
