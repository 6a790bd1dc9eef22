"""`moe.select_experts` in one Triton launch for CUDA tensors: one program per token takes its row of
router logits, the softmax over all experts in float32, the top_k largest probabilities (descending,
the lower expert id first among equal ones) and, with RENORMALIZE, rescales them to sum to 1. The
torch code it replaces is five launches (cast, softmax, topk, sum, divide) per MoE layer, which at
batch-1 decode cost more than the routing itself. Under programmatic dependent launch
(`rxf/core/runner/pdl.py`) it waits first: it reads nothing but the logits.

`route_cuda` goes one launch further for decode batches (at most `ROUTE_MAX_TOKENS` tokens): the
router projection itself, x @ W^T (+ bias), is computed by the same kernel, so a MoE layer's routing
is one launch instead of a GEMV and the kernel above. Grid (tokens, SPLIT_K): program (t, s) takes
the dot products of token t with every expert's weight row over its K range, in float32, and writes
them to `partials`; the last of a token's SPLIT_K programs to arrive (`fused_moe_decode`'s counter
hand-off: stores, a CTA barrier, an acq_rel atomic, `.cg` loads) sums them in split order, adds the
bias, rounds the logits to x's dtype (the `F.linear` output that `select_experts` would get) and
routes them as above. Under PDL it waits first (x comes from the norm before it).

`norm_route_cuda` also takes that norm in: given the attention block's output h and the residual
stream r, every program reads its token's whole rows for the mean square of s = h + r (float32),
then, over its own K range, writes s rounded (the new residual) and x = s * rsqrt(mean(s^2) + eps) * w
rounded once (`rmsnorm_kernel`'s rounding: the norm of the unrounded sum) to fresh tensors, and dots
that rounded x with the router rows. The experts read x after this launch; the residual add and the
post-attention norm are then no launch of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl
from rxf.plugins.models.layers.fused_moe_decode import launch_counters

ROUTE_MAX_TOKENS = 16  # larger batches: the router GEMM (cuBLAS) and then the routing kernel
_ROUTE_TILE = 16384  # weights per tile of the fused router (BLOCK_E x TILE_K, in registers)
_ROUTE_SPLIT_CHUNK = 128  # K per program of the fused router (SPLIT_K = cdiv(K, 128)): short loads in series
RANK_MAX_EXPERTS = tl.constexpr(128)  # `_route_store` ranks all experts at once up to this many


@triton.jit
def _route_store(logits, Weights, Ids, token, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Softmax of one token's float32 `logits` [BLOCK_E] over its num_experts lanes, the TOP_K largest
    (descending, the lower id among equals), optionally renormalised, stored at row `token`.

    Up to RANK_MAX_EXPERTS experts, each expert's place in that order is counted at once, as the
    experts before it (a larger probability, or an equal one and a lower id), over a [BLOCK_E, BLOCK_E]
    comparison: one reduction instead of TOP_K rounds of two (a max and an argmin), each a round of
    cross-warp exchanges; the last program of `_router_topk_kernel` runs this after its loads, alone."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.where(valid, logits, -float("inf"))
    exp = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, exp / tl.sum(exp, axis=0), -1.0)  # padding lanes are never chosen
    if BLOCK_E <= RANK_MAX_EXPERTS:
        p_i, p_j = probs[:, None], probs[None, :]
        before = (p_j > p_i) | ((p_j == p_i) & (experts[None, :] < experts[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)
        chosen = rank < TOP_K
        w = probs
        if RENORMALIZE:
            w = probs / tl.sum(tl.where(chosen, probs, 0.0), axis=0)
        tl.store(Weights + token * TOP_K + rank, w, mask=chosen)
        tl.store(Ids + token * TOP_K + rank, experts.to(tl.int64), mask=chosen)
    else:
        slots = tl.arange(0, BLOCK_K)
        top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, axis=0)
            pick = tl.min(tl.where(probs == best, experts, BLOCK_E), axis=0)
            top_w = tl.where(slots == j, best, top_w)
            top_i = tl.where(slots == j, pick.to(tl.int64), top_i)
            probs = tl.where(experts == pick, -1.0, probs)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=0)  # lanes past TOP_K hold 0
        keep = slots < TOP_K
        tl.store(Weights + token * TOP_K + slots, top_w, mask=keep)
        tl.store(Ids + token * TOP_K + slots, top_i, mask=keep)


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
    logits = tl.load(Logits + token * stride_t + experts, mask=experts < num_experts, other=0.0).to(tl.float32)
    _route_store(logits, Weights, Ids, token, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)


@triton.jit
def _routed_x(X, Res, NormW, XOut, ResOut, token, stride_xt, stride_rt, K, cols, ok, inv_rms, NORM: tl.constexpr):
    """Token `token`'s x at `cols` (masked by `ok`) in float32; NORM: s = h + r there, s rounded stored
    to ResOut, and x = s * inv_rms * w rounded once, stored to XOut, is what it returns."""
    x = tl.load(X + token * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        x += tl.load(Res + token * stride_rt + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(ResOut + token * K + cols, x.to(ResOut.dtype.element_ty), mask=ok)
        x = (x * inv_rms * tl.load(NormW + cols, mask=ok, other=0.0).to(tl.float32)).to(XOut.dtype.element_ty)
        tl.store(XOut + token * K + cols, x, mask=ok)
        x = x.to(tl.float32)
    return x


@triton.jit
def _router_topk_kernel(
    X, W, Bias, Partials, Counters, Weights, Ids, Res, NormW, XOut, ResOut, stride_xt, stride_rt, num_experts, K,
    norm_eps,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TILE_K: tl.constexpr,
    SPLIT_K: tl.constexpr, CHUNK_K: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    NORM: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    """NORM: X is the attention output h and Res the residual; the routed x is norm(h + r) (see the
    module docstring), written with h + r to XOut / ResOut (rows of K, contiguous). The first weight
    tile (at Qwen3-30B-A3B's 128 experts the program's whole K range) is read before the PDL wait."""
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    ks = tl.arange(0, TILE_K)
    k_lo = split * CHUNK_K
    end = tl.minimum(k_lo + CHUNK_K, K)
    w_rows = W + experts[:, None].to(tl.int64) * K + ks[None, :]
    w = tl.load(w_rows + k_lo, mask=valid[:, None] & (k_lo + ks < end)[None, :], other=0.0)
    if PDL:  # the kernel before writes x (or h)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    inv_rms = 0.0
    if NORM:
        cols = tl.arange(0, BLOCK_H)
        row = tl.load(X + token * stride_xt + cols, mask=cols < K, other=0.0).to(tl.float32)
        row += tl.load(Res + token * stride_rt + cols, mask=cols < K, other=0.0).to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(row * row, axis=0) / K + norm_eps)
    x = _routed_x(X, Res, NormW, XOut, ResOut, token, stride_xt, stride_rt, K, k_lo + ks, k_lo + ks < end, inv_rms,
                  NORM)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(k_lo + TILE_K, end, TILE_K):
        k_ok = k0 + ks < end
        x = _routed_x(X, Res, NormW, XOut, ResOut, token, stride_xt, stride_rt, K, k0 + ks, k_ok, inv_rms, NORM)
        w = tl.load(w_rows + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SPLIT_K > 1:
        first = Partials + token * (SPLIT_K * BLOCK_E)
        tl.store(first + split * BLOCK_E + experts, acc)
        tl.debug_barrier()  # every thread's partial stores precede the counter update
        arrived = tl.atomic_add(Counters + token, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last of the token's programs sums them, in split order
            acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                acc += tl.load(first + i * BLOCK_E + experts, cache_modifier=".cg")
            tl.store(Counters + token, 0)
            if HAS_BIAS:
                acc += tl.load(Bias + experts, mask=valid, other=0.0).to(tl.float32)
            logits = acc.to(X.dtype.element_ty).to(tl.float32)
            _route_store(logits, Weights, Ids, token, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + experts, mask=valid, other=0.0).to(tl.float32)
        logits = acc.to(X.dtype.element_ty).to(tl.float32)
        _route_store(logits, Weights, Ids, token, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)


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


def route_cuda(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(F.linear(x, weight, bias), top_k, renormalize)` in one launch for at most
    `ROUTE_MAX_TOKENS` tokens of x `[T, K]` (last dimension contiguous) and a contiguous router
    weight `[E, K]` of x's dtype."""
    return _route(x, weight, bias, top_k, renormalize, None)[:2]


def norm_route_cuda(
    h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, *,
    chunk_k: int = _ROUTE_SPLIT_CHUNK, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(routing weights, expert ids, x, h + residual) with x = RMSNorm(h + residual) as `rmsnorm_kernel`
    computes it, routed as `route_cuda` routes it: the residual add, the norm and the routing in one
    launch. h and residual `[T, K]` (rows contiguous), norm_weight `[K]`; x and the sum are new tensors.
    chunk_k (a power of two; SPLIT_K = cdiv(K, chunk_k)) and num_warps: the launch's shape, for
    `benchmarks/gpu_moe_decode.py`'s sweep."""
    assert residual.shape == h.shape and residual.stride(-1) == 1 and norm_weight.shape == (h.shape[1],)
    return _route(h, weight, bias, top_k, renormalize, (residual, norm_weight, eps), chunk_k, num_warps)


def _route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None, chunk_k: int = _ROUTE_SPLIT_CHUNK, num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, k = x.shape
    num_experts = weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must lie in [1, num_experts {num_experts}]")
    assert num_tokens <= ROUTE_MAX_TOKENS and x.stride(-1) == 1 and weight.is_contiguous(), "see route_cuda's contract"
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    if norm is None:
        res, norm_w, eps, x_out, res_out = x, x, 0.0, x, x  # never read or written
    else:
        res, norm_w, eps = norm
        x_out = torch.empty(num_tokens, k, dtype=x.dtype, device=x.device)
        res_out = torch.empty(num_tokens, k, dtype=res.dtype, device=x.device)
    if num_tokens == 0:
        return weights, ids, x_out, res_out
    block_e = triton.next_power_of_2(num_experts)
    assert chunk_k & (chunk_k - 1) == 0 and chunk_k >= 16, f"chunk_k {chunk_k}: a power of two >= 16"
    split_k = triton.cdiv(k, chunk_k)
    partials = torch.empty(num_tokens * split_k * block_e, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x)
    _router_topk_kernel[(num_tokens, split_k)](
        x, weight, bias if bias is not None else weight, partials, launch_counters(x.device, num_tokens),
        weights, ids, res, norm_w, x_out, res_out, x.stride(0), res.stride(0), num_experts, k, eps, TOP_K=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), TILE_K=min(chunk_k, max(16, _ROUTE_TILE // block_e)),
        SPLIT_K=split_k, CHUNK_K=chunk_k, HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
        NORM=norm is not None, BLOCK_H=triton.next_power_of_2(k) if norm is not None else 16, PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )
    return weights, ids, x_out, res_out
