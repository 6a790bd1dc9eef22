"""`moe.select_experts` in one Triton launch for CUDA tensors: one program per token takes its row of
router logits, the softmax over all experts in float32, the top_k largest probabilities (descending,
the lower expert id first among equal ones) and, with RENORMALIZE, rescales them to sum to 1. The
torch code it replaces is five launches (cast, softmax, topk, sum, divide) per MoE layer, which at
batch-1 decode cost more than the routing itself. Under programmatic dependent launch
(`rxf/core/runner/pdl.py`) it waits first: it reads nothing but the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl


@triton.jit
def _softmax_topk_kernel(
    Logits, Weights, Ids, stride_t, num_experts,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the router projection writes the logits (rxf/core/runner/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(Logits + token * stride_t + experts, mask=valid, other=-float("inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, exp / tl.sum(exp, axis=0), -1.0)  # padding lanes are never chosen
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        chosen = tl.min(tl.where(probs == best, experts, BLOCK_E), axis=0)
        top_w = tl.where(slots == j, best, top_w)
        top_i = tl.where(slots == j, chosen.to(tl.int64), top_i)
        probs = tl.where(experts == chosen, -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # lanes past TOP_K hold 0
    keep = slots < TOP_K
    tl.store(Weights + token * TOP_K + slots, top_w, mask=keep)
    tl.store(Ids + token * TOP_K + slots, top_i, mask=keep)


def softmax_topk_cuda(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 `[T, top_k]`, expert ids int64 `[T, top_k]`) from logits `[T, E]`."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must lie in [1, num_experts {num_experts}]")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    pdl = use_pdl(logits)
    _softmax_topk_kernel[(num_tokens,)](
        logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        PDL=pdl, launch_pdl=pdl,
    )
    return weights, ids
