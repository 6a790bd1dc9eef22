"""`moe.select_experts` in one Triton launch for CUDA tensors: one program per token takes its row of
router logits, the softmax over all experts in float32, the top_k largest probabilities (descending,
the lower expert id first among equal ones) and, with RENORMALIZE, rescales them to sum to 1. The
torch code it replaces is five launches (cast, softmax, topk, sum, divide) per MoE layer, which at
batch-1 decode cost more than the routing itself. Under programmatic dependent launch
(`rxf/core/runner/pdl.py`) it waits first: it reads nothing but the logits.

`route_cuda` goes one launch further for decode batches (at most `ROUTE_MAX_TOKENS` tokens): the
router projection itself, x @ W^T (+ bias), is computed by the same kernel, so a MoE layer's routing
is one launch instead of a GEMV and the kernel above. Grid (tokens, cdiv(E, BLOCK_P)): program (t, p)
takes the dot products of token t with experts [p * BLOCK_P, (p + 1) * BLOCK_P) over all of K, in
float32, and writes those logits to `logits`; the last of a token's programs to arrive
(`fused_moe_decode`'s counter hand-off: stores, a CTA barrier, an acq_rel atomic, `.cg` loads) reads
all E of them, adds the bias, rounds them to x's dtype (the `F.linear` output that `select_experts`
would get) and routes them as above. Splitting over experts rather than K leaves the last program
E logits to read, not a partial sum per split. Under PDL the weights' first K tile (at Qwen3-30B-A3B's
shapes all of a program's weights) is read before the wait (x comes from the kernel before).

`norm_route_cuda` also takes that norm in: given the attention block's output h and the residual
stream r, every program reads its token's whole rows, s = h + r (float32), x = s * rsqrt(mean(s^2) +
eps) * w rounded once (`rmsnorm_kernel`'s rounding: the norm of the unrounded sum), and dots that
rounded x with its router rows; program 0 writes s rounded (the new residual) and x to fresh
tensors. The experts read x after this launch; the residual add and the post-attention norm are
then no launch of their own.

Choosing the top k: each probability's float32 bits (it is >= 0, so they order as integers) above
the complement of its expert id form one int64 key, and each of the k rounds is one max over the
keys (the largest probability, the lower id among equal ones). On an H100 the earlier way, every
expert's place counted at once over a [E, E] comparison in 4 warps, took 6.9 us a launch at E = 128
against 0.9 at E = 8 (benchmarks/gpu_route_parts.py, 2026-12-06): most of a Qwen3-30B-A3B layer's
routing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl
from rxf.plugins.models.layers.fused_moe_decode import launch_counters

ROUTE_MAX_TOKENS = 16  # larger batches: the router GEMM (cuBLAS) and then the routing kernel
# The fused router's launch shape (`benchmarks/gpu_route_parts.py` sweeps it): experts per program and
# warps; a program holds BLOCK_P x TILE_K weights in registers, TILE_K up to _TILE_PER_WARP / BLOCK_P a warp.
ROUTER_EXPERTS_PER_PROGRAM = 2
ROUTER_WARPS = 1
_TILE_PER_WARP = 4096


@triton.jit
def _route_store(logits, Weights, Ids, token, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Softmax of one token's float32 `logits` [BLOCK_E] over its num_experts lanes, the TOP_K largest
    (descending, the lower id among equals; see the module docstring), optionally renormalised, stored
    at row `token`."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.where(valid, logits, -float("inf"))
    exp = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, exp / tl.sum(exp, axis=0), -1.0)  # padding lanes: negative keys, never chosen
    low = (BLOCK_E - 1 - experts).to(tl.int64)  # the lower id, the larger key among equal probabilities
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        best_low = best & 0xFFFFFFFF
        top_w = tl.where(slots == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), top_w)
        top_i = tl.where(slots == j, BLOCK_E - 1 - best_low, top_i)
        keys = tl.where(low == best_low, -1, keys)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # lanes past TOP_K hold 0
    keep = slots < TOP_K
    tl.store(Weights + token * TOP_K + slots, top_w, mask=keep)
    tl.store(Ids + token * TOP_K + slots, top_i, mask=keep)


@triton.jit
def _rounded_logits(acc, Bias, experts, num_experts, dtype, HAS_BIAS: tl.constexpr):
    """The router's float32 sums `acc` [BLOCK_E] plus the bias, rounded to x's dtype as `F.linear`
    returns them, back in float32 for `_route_store`."""
    if HAS_BIAS:
        acc += tl.load(Bias + experts, mask=experts < num_experts, other=0.0).to(tl.float32)
    return acc.to(dtype).to(tl.float32)


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
def _router_topk_kernel(
    X, W, Bias, Logits, Counters, Weights, Ids, Res, NormW, XOut, ResOut, stride_xt, stride_rt, num_experts, K,
    norm_eps,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    TILE_K: tl.constexpr, PROGRAMS: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t, p): experts [p * BLOCK_P, (p + 1) * BLOCK_P) of token t over all of K (see the module
    docstring). NORM: X is the attention output h and Res the residual; the routed x is norm(h + r),
    which needs the whole rows at once, so TILE_K >= K there (the launch sees to it)."""
    token = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    rows = p * BLOCK_P + tl.arange(0, BLOCK_P)
    rows_ok = rows < num_experts
    ks = tl.arange(0, TILE_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * K + ks[None, :]
    w = tl.load(w_ptrs, mask=rows_ok[:, None] & (ks < K)[None, :], other=0.0)
    if NORM:
        norm_w = tl.load(NormW + ks, mask=ks < K, other=0.0)
    if PDL:  # the kernel before writes x (or h)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + token * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
    if NORM:
        x += tl.load(Res + token * stride_rt + ks, mask=ks < K, other=0.0).to(tl.float32)
        first = ks < tl.where(p == 0, K, 0)  # program 0 writes the new residual and x
        tl.store(ResOut + token * K + ks, x.to(ResOut.dtype.element_ty), mask=first)
        inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=0) / K + norm_eps)
        x = (x * inv_rms * norm_w.to(tl.float32)).to(XOut.dtype.element_ty)
        tl.store(XOut + token * K + ks, x, mask=first)
        x = x.to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(TILE_K, K, TILE_K):  # K past the first tile (never with NORM)
        k_ok = k0 + ks < K
        x = tl.load(X + token * stride_xt + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    experts = tl.arange(0, BLOCK_E)
    if PROGRAMS > 1:
        tl.store(Logits + token * BLOCK_E + rows, acc, mask=rows_ok)
        tl.debug_barrier()  # every thread's logit stores precede the counter update
        arrived = tl.atomic_add(Counters + token, 1, sem="acq_rel")
        if arrived == PROGRAMS - 1:  # the last of the token's programs routes them all
            total = tl.load(Logits + token * BLOCK_E + experts, mask=experts < num_experts, other=0.0,
                            cache_modifier=".cg")
            tl.store(Counters + token, 0)
            logits = _rounded_logits(total, Bias, experts, num_experts, X.dtype.element_ty, HAS_BIAS)
            _route_store(logits, Weights, Ids, token, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    else:  # one program holds every expert (BLOCK_P == BLOCK_E)
        logits = _rounded_logits(acc, Bias, experts, num_experts, X.dtype.element_ty, HAS_BIAS)
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
    block_e = triton.next_power_of_2(num_experts)
    _softmax_topk_kernel[(num_tokens,)](
        logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        PDL=pdl, num_warps=1 if block_e <= 512 else 4, launch_pdl=pdl,  # one warp: no cross-warp rounds
    )
    return weights, ids


def route_cuda(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
    *, experts_per_program: int = ROUTER_EXPERTS_PER_PROGRAM, num_warps: int = ROUTER_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(F.linear(x, weight, bias), top_k, renormalize)` in one launch for at most
    `ROUTE_MAX_TOKENS` tokens of x `[T, K]` (last dimension contiguous) and a contiguous router
    weight `[E, K]` of x's dtype. experts_per_program (a power of two) and num_warps: the launch's
    shape, for `benchmarks/gpu_route_parts.py`'s sweep."""
    return _route(x, weight, bias, top_k, renormalize, None, experts_per_program, num_warps)[:2]


def norm_route_cuda(
    h: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, *,
    experts_per_program: int = ROUTER_EXPERTS_PER_PROGRAM, num_warps: int = ROUTER_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(routing weights, expert ids, x, h + residual) with x = RMSNorm(h + residual) as `rmsnorm_kernel`
    computes it, routed as `route_cuda` routes it: the residual add, the norm and the routing in one
    launch. h and residual `[T, K]` (rows contiguous), norm_weight `[K]`; x and the sum are new tensors."""
    assert residual.shape == h.shape and residual.stride(-1) == 1 and norm_weight.shape == (h.shape[1],)
    return _route(h, weight, bias, top_k, renormalize, (residual, norm_weight, eps), experts_per_program, num_warps)


def _route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None, experts_per_program: int, num_warps: int,
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
    block_p = min(experts_per_program, block_e)
    assert block_p & (block_p - 1) == 0, f"experts_per_program {experts_per_program}: a power of two"
    programs = triton.cdiv(num_experts, block_p)
    tile_k = triton.next_power_of_2(k)
    if norm is None:  # long rows go in several tiles
        tile_k = max(16, min(tile_k, _TILE_PER_WARP * num_warps // block_p))
    else:  # the norm needs whole rows in one tile: more warps rather than more registers a thread
        num_warps = max(num_warps, min(8, block_p * tile_k // _TILE_PER_WARP))
    logits = torch.empty(num_tokens * block_e, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x)
    _router_topk_kernel[(num_tokens, programs)](
        x, weight, bias if bias is not None else weight, logits, launch_counters(x.device, num_tokens),
        weights, ids, res, norm_w, x_out, res_out, x.stride(0), res.stride(0), num_experts, k, eps, TOP_K=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_P=block_p, TILE_K=tile_k, PROGRAMS=programs,
        HAS_BIAS=bias is not None, RENORMALIZE=renormalize, NORM=norm is not None, PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl,
    )
    return weights, ids, x_out, res_out
