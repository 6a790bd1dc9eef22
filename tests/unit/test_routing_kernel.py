"""The one-launch MoE routing kernel (softmax over the experts, top-k, optional renormalisation) and the
fused router (the router projection in the same launch) against `moe.select_experts`' torch code, on
CPU under the Triton interpreter.

As in test_fused_moe.py, TRITON_INTERPRET is set before the kernel module is imported, and the module
is skipped where CUDA is present (the GPU tests route through it).
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the GPU tests cover the compiled kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from rxf.plugins.models.layers.moe import select_experts  # noqa: E402
from rxf.plugins.models.layers.routing_kernel import norm_route_cuda, route_cuda, softmax_topk_cuda  # noqa: E402


def assert_same_routing(logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, top_k: int,
                        renormalize: bool) -> None:
    """Against the torch code on the CPU copy: the same weights, and ids that are a top-k of the
    softmax (equal probabilities, common with half-precision logits, may be chosen either way)."""
    want_w, want_i = select_experts(logits.cpu(), top_k, renormalize)
    weights, ids = weights.cpu(), ids.cpu()
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == want_i.shape
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)  # both descending
    probs = torch.softmax(logits.cpu().float(), dim=-1)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, True)
    assert (chosen.sum(-1) == top_k).all(), "an expert chosen twice"
    lowest_chosen = probs.masked_fill(~chosen, 2.0).min(-1).values
    highest_other = probs.masked_fill(chosen, -1.0).max(-1).values
    assert (lowest_chosen >= highest_other).all()
    if logits.dtype == torch.float32:  # no ties: the very same experts
        assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want_i.tolist()]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "dtype"),
                         [(5, 128, 8, torch.bfloat16), (9, 60, 4, torch.float32), (1, 8, 2, torch.float16),
                          (3, 16, 16, torch.float32), (40, 128, 8, torch.float32),
                          (2, 256, 8, torch.float32)])  # 256 experts: keys over two lanes a thread
def test_matches_select_experts(tokens: int, experts: int, top_k: int, dtype, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(dtype)
    assert_same_routing(logits, *softmax_topk_cuda(logits, top_k, renormalize), top_k, renormalize)


def test_ties_take_the_lower_expert_and_strided_logits() -> None:
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 9.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    wide = torch.zeros(2, 10)
    wide[:, :6] = rows
    weights, ids = softmax_topk_cuda(wide[:, :6], 3, renormalize=True)  # row stride 10
    assert ids.tolist() == [[5, 1, 2], [0, 1, 2]]
    probs = torch.softmax(rows, -1)
    torch.testing.assert_close(weights[0], probs[0, [5, 1, 2]] / probs[0, [5, 1, 2]].sum())
    torch.testing.assert_close(weights[1], torch.full((3,), 1 / 3))
    with pytest.raises(ValueError, match="top_k 7 must lie in"):
        softmax_topk_cuda(rows, 7, True)
    assert softmax_topk_cuda(rows[:0], 2, False)[1].shape == (0, 2)


@pytest.mark.parametrize(("tokens", "experts", "hidden", "top_k", "dtype", "bias"), [
    (1, 128, 2048, 8, torch.float32, False),  # Qwen3-30B-A3B's router: 64 programs of 2 experts
    (3, 32, 2880, 4, torch.float32, True),  # gpt-oss-20b's, with its bias; K not a multiple of the tile
    (16, 60, 300, 4, torch.float16, False),  # the most tokens it takes; experts not a power of two
    (2, 8, 64, 2, torch.float32, True),  # Mixtral-like: 4 programs, with a bias
])
def test_fused_router_routes_as_the_projection_then_select_experts(tokens, experts, hidden, top_k, dtype, bias) -> None:
    """The logits are x @ W^T + b rounded to x's dtype, as `F.linear` hands them to `select_experts`
    (float32 sums in another order: the same value after that rounding here), run twice to check the
    counters are left at zero."""
    gen = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    b = (torch.randn(experts, generator=gen) * 0.1).to(dtype) if bias else None
    logits = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    for _ in range(2):
        assert_same_routing(logits, *route_cuda(x, weight, b, top_k, renormalize=True), top_k, renormalize=True)


@pytest.mark.parametrize(("experts_per_program", "num_warps"), [(1, 1), (4, 2), (64, 4)])  # 64: one program, no hand-off
def test_fused_router_launch_shapes_route_alike(experts_per_program: int, num_warps: int) -> None:
    """Every launch shape `benchmarks/gpu_route_parts.py` sweeps gives the routing of the default one,
    down to the weights' bits (the logits are rounded to x's dtype before any routing)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 512, generator=gen).to(torch.float16)
    weight = (torch.randn(64, 512, generator=gen) * 512**-0.5).to(torch.float16)
    logits = torch.nn.functional.linear(x.float(), weight.float()).to(torch.float16)
    got = route_cuda(x, weight, None, 6, True, experts_per_program=experts_per_program, num_warps=num_warps)
    assert_same_routing(logits, *got, 6, renormalize=True)
    want = route_cuda(x, weight, None, 6, True)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize(("tokens", "experts", "hidden", "top_k", "dtype"), [
    (1, 128, 2048, 8, torch.float32),  # Qwen3-30B-A3B
    (4, 8, 320, 2, torch.float16),  # Mixtral-like routing, a hidden size that is not a power of two
])
def test_norm_route_takes_the_residual_add_and_the_norm_in(tokens, experts, hidden, top_k, dtype) -> None:
    """x = RMSNorm(h + r) as `rmsnorm_kernel` rounds it (the norm of the unrounded float32 sum, one
    rounding at the end) and h + r rounded, against that formula in torch; routed as `route_cuda`
    routes x itself."""
    gen = torch.Generator().manual_seed(hidden * tokens)
    h = torch.randn(tokens, hidden, generator=gen).to(dtype)
    r = (torch.randn(tokens, hidden, generator=gen) * 4).to(dtype)
    norm_w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    eps = 1e-6
    s = h.float() + r.float()
    x_ref = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()).to(dtype)
    h_before, r_before = h.clone(), r.clone()
    weights, ids, x, res = norm_route_cuda(h, r, norm_w, eps, weight, None, top_k, renormalize=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(res, s.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(x, x_ref, rtol=tol, atol=tol)
    assert torch.equal(h, h_before) and torch.equal(r, r_before), "the inputs are left as they were"
    want = route_cuda(x, weight, None, top_k, renormalize=True)
    torch.testing.assert_close(weights, want[0], rtol=0, atol=0)
    assert torch.equal(ids, want[1])
