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

`rmsnorm_fp8` has the same kernel quantize its output for an FP8 projection after it (prefill rows
too): the normed row, rounded to the input dtype as `out` would hold it, in FP8 with a float32 scale
per group of inputs (`amax / 448`, the rounding of `fp8_kernels.per_token_group_quant`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl

FP8_MAX = tl.constexpr(448.0)  # a global read inside kernels must be a constexpr


@triton.jit
def _rmsnorm_kernel(X, Res, W, Out, ResOut, S, N, stride_x, stride_r, stride_o, stride_ro, stride_s_row,
                    stride_s_group, eps, HAS_RES: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr, QUANT_GROUP: tl.constexpr):
    # QUANT_GROUP > 0: Out holds FP8 codes and S a scale per group of QUANT_GROUP (a power of two). The
    # row is held as [groups, group] from its load on: reshaping a loaded row into groups went through
    # shared memory byte by byte, and such a launch took 5x the norm and the quantization apart
    # (benchmarks/gpu_fp8_inputs.py, H100, 2026-12-05). Without quantization, one group of BLOCK.
    GROUP: tl.constexpr = QUANT_GROUP if QUANT_GROUP > 0 else BLOCK
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # fixed at load: read before waiting
    if PDL:  # the previous kernel writes x and the residual
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x32 = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x32 += tl.load(Res + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(ResOut + row * stride_ro + cols, x32.to(ResOut.dtype.element_ty), mask=mask)
    normed = x32 * tl.math.rsqrt(tl.sum(tl.sum(x32 * x32, axis=1), axis=0) / N + eps)
    if GEMMA:
        y = normed * (1.0 + w)
    else:
        y = normed * w
    if QUANT_GROUP == 0:
        tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)
    else:
        groups = y.to(X.dtype.element_ty).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-12), FP8_MAX)
        q = tl.clamp(tl.math.div_rn(groups, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(Out + row * stride_o + cols, q.to(Out.dtype.element_ty), mask=mask)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(S + row * stride_s_row + g * stride_s_group, scale, mask=g * GROUP < N)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    gemma: bool = False, out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`norm(x + residual)` into `out` (default: a new tensor), writing `x + residual` into
    `res_out` (default: `residual`, in place); without a residual, `norm(x)`."""
    out = torch.empty_like(x) if out is None else out
    if residual is not None and res_out is None:
        res_out = residual
    _launch(x, weight, eps, residual, gemma, out, res_out if residual is not None else out, None, 0)
    return out


def rmsnorm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, group: int | None, *,
    gemma: bool = False, pad_rows: int = 1, column_major: bool = False, out_dtype: torch.dtype = torch.float8_e4m3fn,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`norm(x + residual)` in FP8 `[M', N]`, float32 scales `[M', ceil(N / group)]`; group None:
    one per row), `x + residual` written into `residual`. As `per_token_group_quant`: M' = M rounded
    up to `pad_rows` (padding rows: zero codes, unit scales), `column_major` scales. `group` must be
    a power of two."""
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    quant_group = block if group is None else group
    if quant_group & (quant_group - 1) or quant_group > block:
        raise ValueError(f"rmsnorm_fp8: group {group} is not a power of two within the row ({n})")
    padded = -(-rows // pad_rows) * pad_rows
    n_groups = -(-n // quant_group)
    q = torch.empty(padded, n, dtype=out_dtype, device=x.device)
    scale = (torch.empty(n_groups, padded, device=x.device).t() if column_major
             else torch.empty(padded, n_groups, device=x.device))
    q[rows:].zero_()
    scale[rows:].fill_(1.0)
    if rows:
        _launch(x, weight, eps, residual, gemma, q, residual if residual is not None else q, scale, quant_group)
    return q, scale


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, gemma: bool,
            out: torch.Tensor, res_out: torch.Tensor, scale: torch.Tensor | None, quant_group: int) -> None:
    block = triton.next_power_of_2(x.shape[1])
    res = residual if residual is not None else x  # unused without a residual
    s = scale if scale is not None else out  # unused unless quantizing
    pdl = use_pdl(x)
    _rmsnorm_kernel[(x.shape[0],)](
        x, res, weight, out, res_out, s, x.shape[1], x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        s.stride(0), s.stride(1) if s.dim() > 1 else 1, eps,
        HAS_RES=residual is not None, GEMMA=gemma, BLOCK=block, PDL=pdl, QUANT_GROUP=quant_group,
        num_warps=max(1, min(16, block // 512)), launch_pdl=pdl,
    )
