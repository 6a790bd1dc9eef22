"""Linear layers laid out for tensor parallelism, with the fused projections models load into.

Column-parallel layers split their output features across ranks (no communication: the next
row-parallel layer consumes the shard), row-parallel layers split their input features and
all-reduce their output (DESIGN §9). Each parameter carries a
`weight_loader(param, checkpoint_tensor[, shard_id])` that takes the full checkpoint tensor and
copies in this rank's slice, so checkpoints load unchanged at any tp_size. `tp_size` / `tp_rank`
default to this process's tensor-parallel group (`rxf.core.runner.distributed`).

One loader serves every parameter: a parameter's `TensorLayout` says which of its dimensions runs
along the output and the input features and how many features one element covers there (packed
int4 holds 8, a block scale 128), so a quantization method's tensors slice like the dense weight.
Built inside `rxf.core.quantization.building(method)`, a layer leaves its dense weight on the meta
device (`quant_pending`) and `materialize` gives it the method's parameters or its dense weight;
the matmul of a quantized layer is `quant.apply(layer, x, bias)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rxf.core import quantization
from rxf.core.runner import distributed
from rxf.plugins.models.layers.gemv import DecodeGemv, decode_gemv
from rxf.plugins.quantization import cpu_packing


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


@dataclass(frozen=True)
class TensorLayout:
    """How a parameter's dimensions map onto the layer's features, for tensor-parallel slicing.

    `out_dim` / `in_dim`: the dimension along the output / input features (None: not split, the
    whole checkpoint tensor on every rank); `out_pack` / `in_pack`: features per element along it.
    `per_shard`: one value per checkpoint shard (a per-tensor scale), `[num_shards]`.
    `dtypes`: the checkpoint dtypes it accepts (None: any, converted by the copy).
    """

    out_dim: int | None = 0
    in_dim: int | None = 1
    out_pack: int = 1
    in_pack: int = 1
    per_shard: bool = False
    dtypes: tuple[torch.dtype, ...] | None = None


DENSE = TensorLayout()
BIAS = TensorLayout(in_dim=None)


def _narrow(t: torch.Tensor, dim: int, start: int, n: int, pack: int, what: str) -> torch.Tensor:
    if start % pack or n % pack:
        raise ValueError(f"{what}: features [{start}, {start + n}) do not fall on its {pack}-feature blocks")
    if (start + n) // pack > t.shape[dim]:
        raise ValueError(f"{what}: checkpoint shape {tuple(t.shape)} does not fit: too few elements along dim {dim} "
                         f"for features [{start}, {start + n}) at {pack} per element")
    return t.narrow(dim, start // pack, n // pack)


class _TPLinear(nn.Module):
    """`y = x @ weight.T + bias` with weight `[out_per_rank, in_per_rank]`; subclasses define
    `weight_loader`, which says how a full checkpoint tensor maps onto this rank's slice.
    `use_decode_gemv(role)` lets small CUDA batches go through rxf's Triton GEMV where `layers/gemv.py`
    gives `role` one (by default on Hopper; `RXF_GEMV` overrides); cuBLAS otherwise."""

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
        self.in_per_rank, self.out_per_rank = in_per_rank, out_per_rank
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()  # the model's compute dtype
        self.quant: quantization.QuantizationMethod | None = None
        # Under a quantization method the dense weight waits on the meta device for `materialize`.
        self.quant_pending = quantization.active_method() is not None
        self.create_dense_weight()
        self.bias: nn.Parameter | None = None
        if bias:
            self.add_param("bias", torch.empty(out_per_rank, dtype=dtype), BIAS)
        self.gemv: DecodeGemv | None = None
        self.packed_weight: torch.Tensor | None = None  # the dense weight in oneDNN's layout (`pack_for_device`)
        self.plain_weight: torch.Tensor | None = None  # and as it is, for the few-row kernel (`cpu_packing`)
        self.upcast_min_rows: int | None = None  # emulated bf16: batches this large run in float32 (`cpu_packing`)

    def create_dense_weight(self) -> None:
        # torch.empty: every value is overwritten by the checkpoint, so skip the random init.
        device = "meta" if self.quant_pending else None
        self.add_param("weight", torch.empty(self.out_per_rank, self.in_per_rank, dtype=self.dtype, device=device))

    def add_param(self, name: str, data: torch.Tensor, layout: TensorLayout = DENSE) -> nn.Parameter:
        """Register `data` as parameter `name`, loaded through `weight_loader` as `layout` says."""
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        param.tp_layout = layout
        shard_ids = getattr(self, "shard_ids", None)
        if shard_ids is not None:  # the loader checks that every shard of a fused parameter was filled
            param.shard_ids = shard_ids
        setattr(self, name, param)
        return param

    def decode_gemv(self, role: str, gated: bool = False) -> DecodeGemv | None:
        """The GEMV `decode_gemv` gives `role` over this layer's dense weight (None for a quantized one)."""
        return None if self.quant_pending or self.quant is not None else decode_gemv(role, self.weight, gated=gated)

    def use_decode_gemv(self, role: str) -> None:
        """Serve small CUDA batches with the GEMV that `decode_gemv` gives `role` (if any)."""
        self.gemv = self.decode_gemv(role)

    def pack_for_device(self) -> None:
        """After loading (`rxf.core.quantization.finish_loading`): a dense bf16 CPU weight moves into
        oneDNN's packed layout, which the matmul reads from then on (`cpu_packing`); the `weight`
        Parameter stays as a meta tensor, its shape and dtype without the memory, unless the few-row
        kernel reads it (`cpu_packing.keeps_plain_weight`). Where oneDNN has no bf16 kernels, batches of
        `UPCAST_MIN_ROWS` or more compute in float32 instead."""
        if self.quant is not None or self.quant_pending:
            return
        if cpu_packing.emulated_bf16(self.weight):
            self.upcast_min_rows = cpu_packing.UPCAST_MIN_ROWS
        elif cpu_packing.dense_packable(self.weight):
            self.packed_weight = cpu_packing.pack_dense(self.weight.data)
            if cpu_packing.keeps_plain_weight():
                self.plain_weight = self.weight.data
            else:
                self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def out_slice(self, shard_id: str | int | None) -> tuple[int, int, int] | None:
        """(first checkpoint feature, first feature of this rank's parameter, count) along the
        output for `shard_id`; None when the output is not split."""
        n = self.out_per_rank
        return self.tp_rank * n, 0, n

    def in_slice(self) -> tuple[int, int] | None:
        """(first checkpoint feature, count) of this rank's inputs; None when not split."""
        return None

    def shard_index(self, shard_id: str | int | None) -> int:
        return 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        """Copy this rank's slice of the full checkpoint tensor `loaded` (shard `shard_id` of a
        fused layer) into `param`, as its `layout` says."""
        layout: TensorLayout = param.tp_layout
        what = type(self).__name__ + ("" if shard_id is None else f" shard {shard_id}")
        if layout.dtypes is not None and loaded.dtype not in layout.dtypes:
            expected = " or ".join(str(d).removeprefix("torch.") for d in layout.dtypes)
            raise ValueError(f"{what}: checkpoint dtype {str(loaded.dtype).removeprefix('torch.')}, expected {expected}")
        dst, src = param.data, loaded
        if layout.per_shard:
            i = self.shard_index(shard_id)
            copy_weight(dst[i : i + 1], src.reshape(-1) if src.numel() == 1 else src, what)
            return
        out = self.out_slice(shard_id) if layout.out_dim is not None else None
        if out is not None:
            src_start, dst_start, n = out
            src = _narrow(src, layout.out_dim, src_start, n, layout.out_pack, what)
            dst = _narrow(dst, layout.out_dim, dst_start, n, layout.out_pack, what)
        inp = self.in_slice() if layout.in_dim is not None else None
        if inp is not None:
            src = _narrow(src, layout.in_dim, inp[0], inp[1], layout.in_pack, what)
        copy_weight(dst, src, what)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, act: nn.Module | None = None) -> torch.Tensor:
        if act is not None:
            fused = self.quant.apply_gated(self, x, act, bias) if self.quant is not None else None
            if fused is not None:
                return fused
            x = act(x)
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        if self.packed_weight is not None:
            return cpu_packing.dense_linear(x, self.packed_weight, self.plain_weight, bias)
        if self.upcast_min_rows is not None and x.numel() >= self.upcast_min_rows * x.shape[-1]:
            return cpu_packing.upcast_linear(x, self.weight, bias)
        if self.gemv is not None and self.gemv.applies(x):
            return self.gemv(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        """`x @ W.T + bias`; given a gated activation `act` (an MLP's down projection), of `act(x)`,
        which a quantization method may compute inside its input quantization (`apply_gated`)."""
        return self._matmul(x, self.bias, act)

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`forward(norm(h + residual))`, `h + residual`) with the add and the norm inside a quantized
        layer's input pass (`apply_normed`); None where that does not apply (a dense layer: the decode
        GEMV taking the norm in was slower than the norm's own launch, `gemv_kernel`'s docstring)."""
        if self.quant is None:
            return None
        return self.quant.apply_normed(self, h, residual, norm, self.bias)

    def forward_activated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor | None:
        """`act(forward(x))` in the quantization method's one launch (`apply_activated`); None where the
        method has none (a dense layer's gated GEMV is the model's `decode_gemv(..., gated=True)`)."""
        return None if self.quant is None else self.quant.apply_activated(self, x, act, self.bias)


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

    def shard_start(self, i: int) -> int:
        """First row of this rank's slice of checkpoint shard i."""
        return self.tp_rank * self.shard_sizes[i]

    def shard_index(self, shard_id: str | int | None) -> int:
        if shard_id not in self.shard_ids:
            raise ValueError(f"{type(self).__name__}: unknown shard {shard_id!r} (shards {self.shard_ids})")
        return self.shard_ids.index(shard_id)

    def out_slice(self, shard_id: str | int | None) -> tuple[int, int, int]:
        i = self.shard_index(shard_id)
        return self.shard_start(i), self.shard_offsets[i], self.shard_sizes[i]


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

    def out_slice(self, shard_id: str | int | None) -> None:
        return None  # every rank holds all outputs (partial sums); the bias is not split

    def in_slice(self) -> tuple[int, int]:
        return self.tp_rank * self.in_per_rank, self.in_per_rank

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias, act)
        out = distributed.tp_all_reduce(self._matmul(x, None, act))
        return out if self.bias is None else out + self.bias
