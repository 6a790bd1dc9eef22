"""RMSNorm, optionally fused with the residual add before it, for the few rows of a decode step, in
Triton with programmatic dependent launch (`rxf/core/runner/pdl.py`).

FlashInfer's norm kernels wait for the previous kernel at their start and let the next one launch only
at their end; at batch 1 a norm is ~3 us, mostly start-up, and the projection after it cannot begin
streaming its weights until the norm is done. This kernel lets the next kernel launch at once (a
projection then reads its first weight tiles while the norm runs) and reads its own weight before
waiting.

One program per row, the whole row in registers (`norm.PDL_MAX_HIDDEN` bounds the hidden size).
Rounding is FlashInfer's, the norm this kernel stands in for at decode (prefill keeps FlashInfer's):
`s = x + r` in float32, stored rounded as the new residual, and `s * rsqrt(mean(s^2) + eps) * w`
(Gemma: `1 + w`) of the unrounded `s` in float32, rounded once. (Rounding as `forward_native` does,
decode and prefill disagreed by a bf16 step here and there, and the bf16 greedy tokens of
tests/gpu/test_cuda_graph_gpu.py strayed from transformers' further than its bound allows.)
In place: `out` may be `x` and `res_out` may be `residual` (a program reads its row before writing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl


@triton.jit
def _rmsnorm_kernel(X, Res, W, Out, ResOut, N, stride_x, stride_r, stride_o, stride_ro, eps,
                    HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # fixed at load: read before waiting
    if PDL:  # the previous kernel writes x and the residual
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x32 = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x32 += tl.load(Res + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(ResOut + row * stride_ro + cols, x32.to(ResOut.dtype.element_ty), mask=mask)
    normed = x32 * tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    if GEMMA:
        y = normed * (1.0 + w)
    else:
        y = normed * w
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    gemma: bool = False, out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`norm(x + residual)` into `out` (default: a new tensor), writing `x + residual` into
    `res_out` (default: `residual`, in place); without a residual, `norm(x)`."""
    rows, n = x.shape
    out = torch.empty_like(x) if out is None else out
    if residual is not None and res_out is None:
        res_out = residual
    res, res_o = (residual, res_out) if residual is not None else (x, out)  # unused without a residual
    block = triton.next_power_of_2(n)
    pdl = use_pdl(x)
    _rmsnorm_kernel[(rows,)](
        x, res, weight, out, res_o, n, x.stride(0), res.stride(0), out.stride(0), res_o.stride(0), eps,
        HAS_RES=residual is not None, GEMMA=gemma, BLOCK=block, PDL=pdl,
        num_warps=max(1, min(16, block // 512)), launch_pdl=pdl,
    )
    return out
