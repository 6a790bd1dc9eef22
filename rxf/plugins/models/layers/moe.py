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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rxf.core import quantization
from rxf.core.runner import distributed
from rxf.plugins.models.layers.linear import copy_weight


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
            gate, up = F.linear(rows, w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
            outs.append(F.linear(activation(gate, up), w2[e], None if b2 is None else b2[e]))
    y = torch.cat(outs) * topk_weights.reshape(-1)[order, None]
    return torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add_(0, tokens, y).to(x.dtype)


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
        dtype: torch.dtype | None, bias: bool = False,
    ) -> None:
        super().__init__()
        self.split_dim, self.parts = split_dim, parts
        self.tp_size, self.tp_rank = tp
        shard_ids = tuple((e, j) for e in range(num_experts) for j in range(parts))
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.shard_ids = shard_ids
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts, rows, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
            self.bias.shard_ids = shard_ids

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, j = shard_id
        n = param.shape[1 + self.split_dim] // self.parts
        dst = param.data[expert].narrow(self.split_dim, j * n, n)
        what = f"expert {expert} part {j}"
        if loaded.dim() != 2 or loaded.shape[self.split_dim] != n * self.tp_size:
            raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)} "
                             f"x tp_size {self.tp_size} along dim {self.split_dim}")
        copy_weight(dst, loaded.narrow(self.split_dim, self.tp_rank * n, n), what)

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
        # Under a quantization method `materialize` asks it whether it takes the experts over.
        self.quant_pending = quantization.active_method() is not None
        self.w13 = StackedExpertWeight(num_experts, 2 * inter, hidden_size, 0, 2, tp, dtype, bias)
        self.w2 = StackedExpertWeight(num_experts, hidden_size, inter, 1, 1, tp, dtype, bias)

    def create_dense_weight(self) -> None:
        """Left unquantized: the weights built in `__init__` stay."""

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        extra = {"b13": self.w13.bias, "b2": self.w2.bias, "activation": self.activation}
        if x.is_cuda:
            from rxf.plugins.models.layers.fused_moe import fused_experts

            return fused_experts(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids, **extra)
        return experts_native(x, self.w13.weight, self.w2.weight, topk_weights, topk_ids, **extra)
