"""The ipc:// addresses of one engine's sockets, all in its private (0700) runtime directory.

Names: "tokenizer" (the TokenizerManager's PULL socket: text batches, stats, admin replies),
"detokenizer" (the detokenizer's PULL socket: token batches), and one scheduler PULL socket per
data-parallel replica: "scheduler" for replica 0, "scheduler_dp<d>" for the others.
"""

from __future__ import annotations


def replica_addr_key(dp_rank: int) -> str:
    return "scheduler" if dp_rank == 0 else f"scheduler_dp{dp_rank}"


def engine_addrs(ipc_dir: str, dp_size: int) -> dict[str, str]:
    """Every socket address of an engine with `dp_size` replicas, by name."""
    names = [replica_addr_key(d) for d in range(dp_size)] + ["detokenizer", "tokenizer"]
    return {name: f"ipc://{ipc_dir}/{name}" for name in names}


def replica_addrs(addrs: dict[str, str]) -> list[str]:
    """The scheduler address of every replica, in replica order."""
    out = [addrs["scheduler"]]
    while f"scheduler_dp{len(out)}" in addrs:
        out.append(addrs[f"scheduler_dp{len(out)}"])
    return out
