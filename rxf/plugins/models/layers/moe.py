"""Mixture-of-experts feed-forward: top-k routing and the experts' weights in a fused layout.

`FusedExperts` holds every expert's gated MLP as two stacked parameters, `w13.weight`
`[E, 2 * I_rank, H]` (rows `[gate | up]` of each expert) and `w2.weight` `[E, H, I_rank]`, where
`I_rank = intermediate / tp_size`: tensor parallelism splits each expert's intermediate dimension
(rank r holds gate/up rows and down columns `[r * I_rank, (r + 1) * I_rank)`), so every rank computes
a partial sum of each token's output and the caller all-reduces it. Checkpoints store one tensor per
expert and projection; the loaders take the full tensor with shard id `(expert, j)`, j = 0 for
gate (w1) and down (w2), 1 for up (w3), and copy this rank's slice. Expert parallelism (whole
experts per rank) is not implemented.

Optional per-expert biases (gpt-oss): `w13.bias` `[E, 2 * I_rank]` split like w13's rows, and
`w2.bias` `[E, H]`, which only rank 0 holds (the others hold zeros) so that the all-reduce adds it
once. The activation is a `GatedActivation`: SiLU·up by default, gpt-oss's clamped form otherwise.

Forward: on CUDA, the Triton kernels of `fused_moe` (imported on first use: plugins touch no kernel
library at import); elsewhere `experts_native`, which is also their reference in the tests.

Quantized experts: a quantization method that takes the experts over (`rxf.core.quantization`)
registers their parameters on `w13` / `w2` (`StackedExpertWeight.add_param`, loaded like the weight)
and computes the forward (`apply_experts`); FP8 weights reach the kernels with their `ExpertScales`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rxf.core import quantization
from rxf.core.runner import distributed
from rxf.plugins.models.layers.linear import DENSE, TensorLayout, _narrow, copy_weight
from rxf.plugins.models.layers.norm import RMSNorm
from rxf.plugins.quantization import cpu_packing


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 `[T, top_k]`, expert ids int64 `[T, top_k]`): softmax over all experts in
    float32, the top_k largest, optionally rescaled to sum to 1 per token (Mixtral does). On CUDA
    one Triton launch (`routing_kernel.py`; among equal probabilities it takes the lower id)."""
    if router_logits.is_cuda:
        from rxf.plugins.models.layers.routing_kernel import softmax_topk_cuda

        return softmax_topk_cuda(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(x: torch.Tensor, router: nn.Module, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(router(x), top_k, renormalize)` for a dense router layer (`weight` `[E, K]`,
    optional `bias`); for CUDA decode batches one launch that also computes the router projection
    (`routing_kernel.route_cuda`)."""
    weight = router.weight
    if x.is_cuda and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous():
        from rxf.plugins.models.layers.routing_kernel import ROUTE_MAX_TOKENS, route_cuda

        if x.shape[0] <= ROUTE_MAX_TOKENS:
            return route_cuda(x, weight, router.bias, top_k, renormalize)
    return select_experts(router(x), top_k, renormalize)


def norm_and_route(
    h: torch.Tensor, residual: torch.Tensor, norm: nn.Module, router: nn.Module, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(weights, ids, x, h + residual) with x = norm(h + residual) routed as `route` routes it, the
    residual add, the norm and the routing in one launch (`routing_kernel.norm_route_cuda`), for CUDA
    decode batches, a plain `RMSNorm` and a dense router of h's dtype; None elsewhere (the caller
    then runs the norm and `route`)."""
    weight = router.weight
    if not (h.is_cuda and type(norm) is RMSNorm and h.dim() == 2 and h.is_contiguous()
            and residual.is_contiguous() and weight.is_contiguous()
            and h.dtype == residual.dtype == weight.dtype == norm.weight.dtype):
        return None
    from rxf.plugins.models.layers.routing_kernel import ROUTE_MAX_TOKENS, norm_route_cuda

    if h.shape[0] > ROUTE_MAX_TOKENS:
        return None
    return norm_route_cuda(h, residual, norm.weight, norm.eps, weight, router.bias, top_k, renormalize)


@dataclass(frozen=True)
class GatedActivation:
    """`act(gate, up) = (u + up_offset) * g * sigmoid(alpha * g)`, with g = min(gate, limit) and
    u = clamp(up, -limit, limit) when `limit` is set. The default is SiLU(gate) * up (Mixtral, Qwen);
    gpt-oss uses alpha 1.702, limit 7 and up_offset 1 (its `swiglu_alpha` / `swiglu_limit`)."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self == SILU:
            return F.silu(gate) * up
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return (up + self.up_offset) * (gate * torch.sigmoid(gate * self.alpha))


SILU = GatedActivation()


def experts_native(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, activation: GatedActivation = SILU,
) -> torch.Tensor:
    """`sum_j topk_weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t)))` with e = topk_ids[t, j], each
    projection with expert e's bias when `b13` `[E, 2I]` / `b2` `[E, H]` are given, in torch: the
    (token, expert) pairs sorted by expert, one pair of matmuls per expert that has pairs (a Python
    loop over experts, never over tokens), and an index_add back to the tokens."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k  # pair p is (token p // top_k, choice p % top_k)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    outs = []
    for e, rows in enumerate(x[tokens].split(counts)):
        if rows.shape[0]:
            gate, up = _linear(rows, w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
            outs.append(_linear(activation(gate, up), w2[e], None if b2 is None else b2[e]))
    y = torch.cat(outs) * topk_weights.reshape(-1)[order, None]
    return torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add_(0, tokens, y).to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # An expert's rows in float32 where bf16 is emulated on this CPU, as the dense layers do (`cpu_packing`).
    if x.shape[0] >= cpu_packing.UPCAST_MIN_ROWS and cpu_packing.emulated_bf16(w):
        return cpu_packing.upcast_linear(x, w, b)
    return F.linear(x, w, b)


@dataclass(frozen=True)
class ExpertScales:
    """The float32 scales of FP8 expert weights (`w = w_fp8 * scale`): per output row and block of
    `block_k` inputs, `w13` `[E, 2I, ceil(H / block_k)]` and `w2` `[E, H, ceil(I / block_k)]`; with
    `block_k` None, per output row, `[E, 2I, 1]` and `[E, H, 1]`. The kernels read the weights in
    FP8 and multiply them back in registers; the activations stay in the model's dtype."""

    w13: torch.Tensor
    w2: torch.Tensor
    block_k: int | None = None


def kernel_scale_args(
    scales: ExpertScales | None, block_k: int, w13: torch.Tensor, w2: torch.Tensor
) -> tuple[dict[str, int | bool], torch.Tensor, torch.Tensor]:
    """(the fused MoE kernels' scale constexprs plus `kernel_block_k`, the w13 and w2 scale tensors)
    for K tiles of `block_k` inputs. Block scales need every K tile inside one scale block: the tile
    shrinks to the scale block when larger (both powers of two, so one then divides the other).
    Without scales the weights stand in for the scale pointers, which the kernels then never read."""
    if scales is None:
        return {"ROW_SCALED": False, "BLOCK_SCALED": False, "SCALE_BK": 1, "kernel_block_k": block_k}, w13, w2
    bk = scales.block_k
    for name, t, w in (("w13", scales.w13, w13), ("w2", scales.w2, w2)):
        blocks = 1 if bk is None else -(-w.shape[2] // bk)
        if t.dtype != torch.float32 or t.shape != (*w.shape[:2], blocks):
            raise ValueError(f"fused_experts: {name} scales must be float32 {[*w.shape[:2], blocks]} for weights "
                             f"{list(w.shape)}, got {t.dtype} {list(t.shape)}")
    if bk is None:
        return {"ROW_SCALED": True, "BLOCK_SCALED": False, "SCALE_BK": 1, "kernel_block_k": block_k}, scales.w13, scales.w2
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fused_experts: FP8 scale blocks of {bk} inputs; the kernels take powers of two >= 16")
    tile = min(block_k, bk)
    return {"ROW_SCALED": False, "BLOCK_SCALED": True, "SCALE_BK": bk, "kernel_block_k": tile}, scales.w13, scales.w2


class StackedExpertWeight(nn.Module):
    """One projection of every expert, `weight[E, rows, cols]`, this rank's slice of it, and with
    `bias` its per-expert bias `[E, rows]`.

    Checkpoint shard `(e, j)` is expert e's full `[out, in]` tensor (or `[out]` bias): its slice at
    this rank along `split_dim` (0: output rows, 1: input columns) fills part j of `weight[e]` along
    that dimension. A bias follows the rows when they are split; when the columns are (the output is
    a partial sum), rank 0 holds the whole bias and every other rank zeros.
    """

    def __init__(
        self, num_experts: int, rows: int, cols: int, split_dim: int, parts: int, tp: tuple[int, int],
        dtype: torch.dtype | None, bias: bool = False, pending: bool = False,
    ) -> None:
        super().__init__()
        self.split_dim, self.parts = split_dim, parts
        self.tp_size, self.tp_rank = tp
        self.num_experts, self.rows, self.cols = num_experts, rows, cols
        self.shard_ids = tuple((e, j) for e in range(num_experts) for j in range(parts))
        # `pending`: the weight waits on the meta device for a quantization method (or the dense weight).
        self.add_param("weight", torch.empty(num_experts, rows, cols, dtype=dtype, device="meta" if pending else None))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts, rows, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
            self.bias.shard_ids = self.shard_ids

    def checkpoint_rows(self) -> int:
        """Rows of one checkpoint tensor of this projection (an expert's full gate, up or down)."""
        part = self.rows // self.parts
        return part * self.tp_size if self.split_dim == 0 else part

    def add_param(self, name: str, data: torch.Tensor, layout: TensorLayout = DENSE) -> nn.Parameter:
        """Register `data` `[E, ...]` as parameter `name`, each expert's slice loaded from its checkpoint
        tensors as `layout` says of one expert's projection (`linear.TensorLayout`: dim 0 runs along
        the rows, `in_dim` 1 along the columns; `per_shard`: `[E, parts]`, one value per tensor)."""
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        param.tp_layout = layout
        param.shard_ids = self.shard_ids
        setattr(self, name, param)
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, j = shard_id
        layout: TensorLayout = param.tp_layout
        what = f"expert {expert} part {j}"
        if layout.dtypes is not None and loaded.dtype not in layout.dtypes:
            expected = " or ".join(str(d).removeprefix("torch.") for d in layout.dtypes)
            raise ValueError(f"{what}: checkpoint dtype {str(loaded.dtype).removeprefix('torch.')}, expected {expected}")
        dst = param.data[expert]
        if layout.per_shard:
            copy_weight(dst[j : j + 1], loaded.reshape(-1) if loaded.numel() == 1 else loaded, what)
            return
        if loaded.dim() != dst.dim():
            raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
        n = dst.shape[0] // self.parts
        dst, src = dst.narrow(0, j * n, n), loaded
        if self.split_dim == 0:
            if src.shape[0] != n * self.tp_size:
                raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)} "
                                 f"x tp_size {self.tp_size} along dim 0")
            src = src.narrow(0, self.tp_rank * n, n)
        elif layout.in_dim is not None and self.tp_size > 1:
            if layout.in_pack == 1 and src.shape[1] != self.cols * self.tp_size:
                raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)} "
                                 f"x tp_size {self.tp_size} along dim 1")
            src = _narrow(src, 1, self.tp_rank * self.cols, self.cols, layout.in_pack, what)
        copy_weight(dst, src, what)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, j = shard_id
        n = param.shape[1] // self.parts
        dst = param.data[expert].narrow(0, j * n, n)
        what = f"expert {expert} bias part {j}"
        if self.split_dim == 1:  # unsplit output: a partial sum on every rank, the bias added once
            copy_weight(dst, loaded, what)
            if self.tp_rank:
                dst.zero_()
            return
        if loaded.dim() != 1 or loaded.shape[0] != n * self.tp_size:
            raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)} "
                             f"x tp_size {self.tp_size}")
        copy_weight(dst, loaded.narrow(0, self.tp_rank * n, n), what)


class FusedExperts(nn.Module):
    """Every expert's gated MLP (`down(act(gate(x), up(x)))`, each projection with its bias when
    `bias`), this rank's share of it; the output is a partial sum when tp_size > 1 (the caller
    all-reduces)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: GatedActivation = SILU,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        tp = (
            distributed.tp_size() if tp_size is None else tp_size,
            distributed.tp_rank() if tp_rank is None else tp_rank,
        )
        if intermediate_size % tp[0]:
            raise ValueError(f"intermediate_size {intermediate_size} is not divisible by tp_size {tp[0]}")
        inter = intermediate_size // tp[0]
        self.activation = activation
        self.dtype = dtype if dtype is not None else torch.get_default_dtype()  # the compute dtype
        self.quant: quantization.QuantizationMethod | None = None
        # Under a quantization method the weights wait on the meta device for `materialize`, which
        # asks the method whether it takes the experts over (else `create_dense_weight`).
        self.quant_pending = quantization.active_method() is not None
        pending = self.quant_pending
        self.w13 = StackedExpertWeight(num_experts, 2 * inter, hidden_size, 0, 2, tp, dtype, bias, pending)
        self.w2 = StackedExpertWeight(num_experts, hidden_size, inter, 1, 1, tp, dtype, bias, pending)

    def create_dense_weight(self) -> None:
        """Left unquantized (called on the device the model is built on): the dense weights."""
        for proj in (self.w13, self.w2):
            proj.add_param("weight", torch.empty(proj.weight.shape, dtype=self.dtype))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply_experts(self, x, topk_weights, topk_ids)
        extra = {"b13": self.w13.bias, "b2": self.w2.bias, "activation": self.activation}
        if x.is_cuda:
            from rxf.plugins.models.layers.fused_moe import fused_experts

            return fused_experts(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids, **extra)
        return experts_native(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids, **extra)
