"""Tensor-parallel group access for model code: the seam between layers and torch.distributed.

Model code asks `tp_size()` / `tp_rank()` when it is built and calls `tp_all_reduce` /
`tp_all_gather` in forward. Until a scheduler process calls `set_tp_group` (through
`init_tensor_parallel`), rxf runs one rank: size 1, rank 0, and both collectives return their input
unchanged (no torch.distributed needed).

A tensor-parallel group is one data-parallel replica: its own default process group (NCCL on GPU,
gloo on CPU) plus a second gloo group over the same ranks for the scheduler's control traffic
(requests are host objects, and a CPU group never waits on GPU work to move them).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from rxf.core.runner.placement import RankPlacement

_group: dist.ProcessGroup | None = None
_cpu_group: dist.ProcessGroup | None = None


def set_tp_group(group: dist.ProcessGroup | None, cpu_group: dist.ProcessGroup | None = None) -> None:
    """Install the tensor-parallel process group of this process (None: back to one rank), and the
    gloo group over the same ranks that `broadcast_from_rank0` uses (defaults to `group`)."""
    global _group, _cpu_group
    _group = group
    _cpu_group = cpu_group if cpu_group is not None else group


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


def broadcast_from_rank0(payload: bytes) -> bytes | memoryview:
    """Rank 0's `payload` on every rank of the group (over the gloo group; the other ranks' argument
    is ignored); with one rank, `payload` itself. Every rank must call it at the same point of its
    loop. The other ranks get a writable view of the received bytes.

    One broadcast of the size, then one of the bytes, unless rank 0's payload is empty (size 0): the
    scheduler loop's common case of no new messages costs one 8-byte broadcast.
    """
    if _cpu_group is None or tp_size() == 1:
        return payload
    src = dist.get_global_rank(_cpu_group, 0)
    leader = tp_rank() == 0
    size = torch.tensor([len(payload) if leader else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=_cpu_group)
    n = int(size.item())
    if n == 0:
        return b""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if leader else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=_cpu_group)
    return payload if leader else memoryview(buf.numpy())


def tp_min(value: int) -> int:
    """The smallest of every rank's `value` (over the gloo group): for sizes the ranks must agree on."""
    if _cpu_group is None or tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())


def init_tensor_parallel(placement: RankPlacement, timeout_s: float = 1800) -> None:
    """Join this replica's process group and install it as the tensor-parallel group. On CUDA the
    caller selects `cuda:<placement.device_index>` first (NCCL binds each rank to one device)."""
    if placement.tp_size == 1:
        return
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=placement.backend,
        init_method=placement.init_method,
        world_size=placement.tp_size,
        rank=placement.rank,
        timeout=timeout,
    )
    world = dist.group.WORLD
    # Control traffic gets a gloo group of its own even when the model's is gloo too: with overlap
    # scheduling on the CPU the model's collectives run in the runner's worker thread while the
    # scheduler thread broadcasts, and each group then sees one thread's calls in program order.
    set_tp_group(world, dist.new_group(backend="gloo", timeout=timeout))
    if placement.backend == "nccl":
        # NCCL creates its communicator on the first collective; do that now, outside any CUDA-graph
        # capture (decode graphs capture the layers' all-reduces).
        tp_all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(None)
