"""Where the engine's scheduler processes run: their ranks, devices and rendezvous port.

Kept free of torch so that the launching process can plan and spawn its children before it
imports torch itself (start-up time: the children's imports are the critical path).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


def free_port() -> int:
    """A TCP port free on this machine now, for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankPlacement:
    """Where one scheduler process sits: its rank in its replica's group and its device.

    Ranks of a replica are spread evenly over the nodes: node n holds ranks
    [n * local_size, (n + 1) * local_size). On GPU, a node's devices are handed out replica after
    replica: replica d's local rank l uses cuda:(d * local_size + l).
    """

    dp_rank: int
    tp_size: int
    nnodes: int
    node_rank: int
    local_rank: int
    init_method: str  # tcp://host:port of this replica's rendezvous
    backend: str  # "nccl" or "gloo"
    cuda: bool = False  # the rank runs on cuda:<device_index>

    @property
    def local_size(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def rank(self) -> int:
        return self.node_rank * self.local_size + self.local_rank

    @property
    def device_index(self) -> int:
        return self.dp_rank * self.local_size + self.local_rank
