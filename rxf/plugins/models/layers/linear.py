"""Linear layers laid out for tensor parallelism, with the fused projections models load into.

Column-parallel layers split their output features across ranks (no communication: the next
row-parallel layer consumes the shard), row-parallel layers split their input features and
all-reduce their output (DESIGN §9). Each parameter carries a
`weight_loader(param, checkpoint_tensor[, shard_id])` that takes the full checkpoint tensor and
copies in this rank's slice, so checkpoints load unchanged at any tp_size. `tp_size` / `tp_rank`
default to this process's tensor-parallel group (`rxf.core.runner.distributed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rxf.core.runner import distributed
from rxf.plugins.models.layers.gemv import DecodeGemv, decode_gemv


def resolve_tp(tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
    """(tp_size, tp_rank), each taken from the installed group when not given."""
    size = distributed.tp_size() if tp_size is None else tp_size
    rank = distributed.tp_rank() if tp_rank is None else tp_rank
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tp_rank {rank} must lie in [0, tp_size {size})")
    return size, rank


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


class _TPLinear(nn.Module):
    """`y = x @ weight.T + bias` with weight `[out_per_rank, in_per_rank]`; subclasses define
    `weight_loader`, which says how a full checkpoint tensor maps onto this rank's slice.
    `use_decode_gemv(role)` lets small CUDA batches go through rxf's Triton GEMV when `RXF_GEMV`
    asks for it (`layers/gemv.py`); cuBLAS otherwise."""

    def __init__(
        self,
        in_per_rank: int,
        out_per_rank: int,
        bias: bool,
        tp_size: int,
        tp_rank: int,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # torch.empty: every value is overwritten by the checkpoint, so skip the random init.
        self.weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_rank, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.gemv: DecodeGemv | None = None

    def use_decode_gemv(self, role: str) -> None:
        """Serve small CUDA batches with the GEMV that `RXF_GEMV` gives `role` (if any)."""
        self.gemv = decode_gemv(role, self.weight)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gemv is not None and self.gemv.applies(x):
            return self.gemv(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ColumnParallelLinear(_TPLinear):
    """Output features split across ranks; each rank holds rows [rank * n, (rank + 1) * n)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        if out_features % tp_size:
            raise ValueError(f"out_features {out_features} is not divisible by tp_size {tp_size}")
        super().__init__(in_features, out_features // tp_size, bias, tp_size, tp_rank, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = param.shape[0]
        copy_weight(param.data, loaded.narrow(0, self.tp_rank * n, n), type(self).__name__)


class MergedColumnParallelLinear(_TPLinear):
    """Several column-parallel projections of one input stored as one weight (e.g. gate | up).

    Shard i of the checkpoint fills rows [sum(sizes[:i]), sum(sizes[:i + 1])) of this rank's weight,
    each shard taking its own rank slice (rows `shard_start(i)` on of the checkpoint tensor).
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool = False,
        *,
        shard_ids: Sequence[str | int] | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        dtype: torch.dtype | None = None,
        per_rank_sizes: Sequence[int] | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        if per_rank_sizes is None:
            if any(size % tp_size for size in out_sizes):
                raise ValueError(f"output sizes {list(out_sizes)} are not divisible by tp_size {tp_size}")
            per_rank_sizes = [size // tp_size for size in out_sizes]
        self.shard_ids = tuple(shard_ids) if shard_ids is not None else tuple(range(len(out_sizes)))
        self.shard_sizes = list(per_rank_sizes)
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(out_sizes))]
        super().__init__(in_features, sum(self.shard_sizes), bias, tp_size, tp_rank, dtype)
        # The loader checks that every shard of a fused parameter was filled.
        for param in self.parameters():
            param.shard_ids = self.shard_ids

    def shard_start(self, i: int) -> int:
        """First row of this rank's slice of checkpoint shard i."""
        return self.tp_rank * self.shard_sizes[i]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int) -> None:
        i = self.shard_ids.index(shard_id)
        n = self.shard_sizes[i]
        dst = param.data.narrow(0, self.shard_offsets[i], n)
        copy_weight(dst, loaded.narrow(0, self.shard_start(i), n), f"{type(self).__name__} shard {shard_id}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused into one `[q | k | v]` weight; shard ids "q", "k", "v".

    A rank holds num_heads / tp_size query heads. KV heads are split the same way while
    tp_size <= num_kv_heads; beyond that each rank holds one kv head, replicated across the
    tp_size / num_kv_heads ranks whose query heads share it (rank r: kv head r * num_kv_heads // tp).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        if num_heads % tp_size:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tp_size {tp_size}")
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads {num_kv_heads} and tp_size {tp_size}: one must divide the other"
            )
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.head_dim = head_dim
        self.kv_head_start = tp_rank * num_kv_heads // tp_size
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias,
            shard_ids=("q", "k", "v"),
            tp_size=tp_size,
            tp_rank=tp_rank,
            dtype=dtype,
            per_rank_sizes=[q, kv, kv],
        )

    def shard_start(self, i: int) -> int:
        return super().shard_start(i) if i == 0 else self.kv_head_start * self.head_dim


class RowParallelLinear(_TPLinear):
    """Input features split across ranks; with tp_size > 1 the partial outputs are all-reduced
    (the bias added once, after the reduce)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size, tp_rank = resolve_tp(tp_size, tp_rank)
        if in_features % tp_size:
            raise ValueError(f"in_features {in_features} is not divisible by tp_size {tp_size}")
        super().__init__(in_features // tp_size, out_features, bias, tp_size, tp_rank, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split
            copy_weight(param.data, loaded, type(self).__name__)
            return
        n = param.shape[1]
        copy_weight(param.data, loaded.narrow(1, self.tp_rank * n, n), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)
        out = distributed.tp_all_reduce(self._matmul(x, None))
        return out if self.bias is None else out + self.bias
