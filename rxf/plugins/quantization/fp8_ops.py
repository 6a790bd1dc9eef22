"""FP8 (E4M3) weights: quantizing, dequantizing, and the matmuls of an FP8 linear layer.

Scales multiply: `w = w_fp8.float() * scale`. Two weight layouts:
  per row (compressed-tensors per-channel, per-tensor expanded to rows, online FP8): `scale` `[N]`;
  per block (Hugging Face `fp8`, `weight_block_size: [bn, bk]`): `scale` `[N, ceil(K / bk)]`, the
      checkpoint's `[ceil(N / bn), ceil(K / bk)]` repeated over each block's rows at load, so fused
      projections whose sizes are not multiples of bn still hold one row of scales per output row.
Activations are quantized when the layer runs: per token (`[M, 1]` scales) for the per-row layout,
per token and group of bk inputs (`[M, ceil(K / bk)]`) for the block layout, or with a static
per-tensor scale (a checkpoint's `input_scale`). On CUDA the matmuls run in FP8: `torch._scaled_mm`
(per-row scales: CUTLASS; 128-wide blocks: cuBLAS's block scaling, CUDA >= 12.9 on Hopper), or the
block-scaled Triton GEMM of `fp8_kernels.py` for block shapes cuBLAS does not take; elsewhere layers
dequantize at load instead.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_TINY = 1e-12  # amax floor: an all-zero row gets a finite scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`w` `[..., N, K]` in FP8, float32 scales `[..., N]`) with each row's absolute max mapped to 448."""
    scale = w.abs().amax(dim=-1).float().clamp(min=_TINY) / FP8_MAX
    q = (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., N, K]` from FP8 `q` and one scale per row (`[..., N]` or `[..., N, 1]`)."""
    return (q.float() * scale.float().reshape(*q.shape[:-1], 1)).to(dtype)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """`[..., N, K]` from FP8 `q` and per-row block scales `scale` `[..., N, ceil(K / block_k)]`."""
    cols = scale.float().repeat_interleave(block_k, dim=-1)[..., : q.shape[-1]]
    return (q.float() * cols).to(dtype)


def quantize_per_token(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 `x` `[M, K]`, float32 scales `[M, ceil(K / group)]`, `[M, 1]` without a group): dynamic
    activation quantization, on CUDA one Triton launch."""
    if x.is_cuda:
        from rxf.plugins.quantization.fp8_kernels import per_token_group_quant

        return per_token_group_quant(x, group or x.shape[1])
    m, k = x.shape
    g = group or k
    pad = (-k) % g
    xs = F.pad(x.float(), (0, pad)).view(m, -1, g)
    scale = xs.abs().amax(dim=2).clamp(min=_TINY) / FP8_MAX
    q = (xs / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8)
    return q, scale


def scaled_mm_rows(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
    bias: torch.Tensor | None, *, gated: bool = False, norm: torch.nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ dequant(w).T + bias` in FP8 on CUDA: `w` `[N, K]` FP8 with float32 row scales `[N]`;
    activations per token (dynamic) or with the static scalar `input_scale`. `gated` / `norm`
    (dynamic activations only): the product takes `SiluAndMul(x)` / `norm(x + residual)` (the
    residual updated in place), computed inside the activation quantization (`quantized_input`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if gated or norm is not None:
        xq, xs = quantized_input(x2, None, False, gated=gated, norm=norm, residual=residual)
    elif input_scale is None:
        xq, xs = quantize_per_token(x2)
    else:
        xq = (x2.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        xs = input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
    out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.reshape(1, -1), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], w.shape[0])


def quantized_input(
    x2: torch.Tensor, group: int | None, cublas: bool, *, gated: bool = False, norm: torch.nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes, float32 scales per token and `group` inputs; None: per token) of a layer's input on
    CUDA, in one launch: of `x2` itself, of `SiluAndMul(x2)` (`gated`), or of `norm(x2 + residual)`
    (`norm`, an RMSNorm: the sum written into `residual`). `cublas`: rows padded to 4 and scales
    column-major, as cuBLAS's block-scaled GEMM reads them."""
    pad, column_major = (4, True) if cublas else (1, False)
    if norm is not None:
        from rxf.plugins.models.layers.rmsnorm_kernel import rmsnorm_fp8

        return rmsnorm_fp8(x2, norm.weight, norm.eps, residual, group, gemma=norm.gemma, pad_rows=pad,
                           column_major=column_major)
    from rxf.plugins.quantization.fp8_kernels import per_token_group_quant

    width = x2.shape[1] // 2 if gated else x2.shape[1]
    return per_token_group_quant(x2, group or width, pad_rows=pad, column_major=column_major, gated=gated)


_FUSED_CHOICES = ("0", "gated", "1")


@functools.cache  # read once per process, off the forward path (tests clear it)
def _fused_inputs() -> str:
    # RXF_FP8_FUSED_INPUT: the launches before an FP8 layer that its activation quantization takes in:
    # "gated" (default) the SiLU·mul before down_proj, "1" also the residual add + RMSNorm before qkv and
    # gate_up, "0" neither. On an H100 (2026-12-05, benchmarks/RESULTS.md, `gpu_fp8_inputs.py`) SiLU·mul +
    # quantization in one launch took 463.6 us at 16k rows against 748.2 for the two (the same codes); the
    # fused norm took 1320.8 against 252.6 (its row went through shared memory a byte at a time) and
    # under "1" made offline FP8 + FP8 KV slower, 30.90 -> 28.41 req/s. With that fixed, "1" against
    # "gated" on an H100 (2026-12-06, alternating runs of one call): 31.27 / 31.12 against 29.93 / 30.92
    # req/s, +2.5% on the means, inside the 3.3% that "gated" moved between its own two runs: not enough
    # to change the default.
    # Timed with block-wise FP8's 128-input groups; per-token scales (online FP8, compressed-tensors) run
    # the same kernel over a whole row per program (no register spills in its sm_90 SASS), not timed.
    value = os.environ.get("RXF_FP8_FUSED_INPUT", "gated")
    if value not in _FUSED_CHOICES:
        raise ValueError(f"RXF_FP8_FUSED_INPUT={value!r}: expected one of {', '.join(_FUSED_CHOICES)}")
    return value


def _gemv_takes(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    qgemv = getattr(layer, "qgemv", None)
    return qgemv is not None and qgemv.takes(x)


def quantizes_gated(layer: torch.nn.Module, x: torch.Tensor, act: torch.nn.Module) -> bool:
    """Whether an FP8 layer on CUDA computes `act(x)` inside its activation quantization: SiLU·mul
    only (the kernel's), and not for the batches the weight-only GEMV takes (it reads `act(x)`)."""
    from rxf.plugins.models.layers.activation import SiluAndMul

    return (x.is_cuda and _fused_inputs() != "0" and type(act) is SiluAndMul
            and not _gemv_takes(layer, x[..., : x.shape[-1] // 2]))


_MAX_NORMED = 16384  # rmsnorm_fp8 holds a row in registers


def quantizes_normed(
    layer: torch.nn.Module, h: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module, group: int | None
) -> bool:
    """Whether an FP8 layer on CUDA computes `norm(h + residual)` inside its activation quantization
    (`rmsnorm_fp8`): Llama's or Gemma's RMSNorm over contiguous half-precision rows, groups of a
    power of two, and not for the batches the weight-only GEMV takes."""
    from rxf.plugins.models.layers.norm import GemmaRMSNorm, RMSNorm

    return (h.is_cuda and _fused_inputs() == "1" and type(norm) in (RMSNorm, GemmaRMSNorm) and h.dim() == 2
            and h.dtype in (torch.float16, torch.bfloat16) and h.is_contiguous() and h.shape[1] <= _MAX_NORMED
            and residual.dtype == h.dtype and residual.is_contiguous()
            and (group is None or group & (group - 1) == 0) and not _gemv_takes(layer, h))


CUBLAS_BLOCK = 128  # cuBLAS's block scaling: 1 x 128 activation groups, 128 x 128 or 1 x 128 weight blocks
# Up to this many rows of x, the GEMM takes a scale per weight row and block even where 128 x 128
# blocks share theirs: on an H100 (2026-12-05, benchmarks/RESULTS.md, `gpu_fp8_gemm.py`) the four
# Llama-3-8B projections summed ran 1.56x / 1.42x of bf16 that way at 8 / 64 rows against 1.35x /
# 1.12x with 128 x 128 blocks, which win from 256 rows on (1.28x against 1.21x). End to end (H100,
# same day): block-wise FP8 Llama-3-8B decoded 3445 tok/s at batch 16 against 3162 with 128 x 128
# blocks only (`RXF_FP8_BLOCK_GEMM=cublas-blocks`), batch 1 unchanged (its GEMV serves it).
ROW_SCALES_MAX_ROWS = 64
# RXF_FP8_BLOCK_GEMM: "cublas" (default: both forms, by row count as above), "cublas-blocks" (128 x 128
# weight blocks wherever each block's rows share their scales), "cublas-rows" (a scale per row and
# block always), "triton" (rxf's kernel). FlashInfer's SM90 port of DeepGEMM was a fifth choice and
# is gone: on an H100 (2026-12-06, benchmarks/RESULTS.md) the four Llama-3-8B projections took 3-8%
# more time in it than in cuBLAS's 128 x 128 blocks from 1k rows on (less only on down_proj at 16k
# rows), and offline FP8 + FP8 KV ran no faster with it.
_GEMM_CHOICES = ("cublas", "cublas-blocks", "cublas-rows", "triton")
_cublas_works: dict[tuple[str, bool], bool] = {}


@dataclass(frozen=True)
class CublasScales:
    """A block-scaled FP8 weight's `scale_b` for `torch._scaled_mm` (cuBLAS) in its two forms: per
    row and block (`[K / 128, N]`, stride 1 along N) and per 128 x 128 block (`[K / 128, N / 128]`
    viewed so, where the blocks' rows share their scales). Either may be None, not both."""

    rows: torch.Tensor | None
    blocks: torch.Tensor | None

    def pick(self, m: int) -> torch.Tensor:
        """The form for an x of `m` rows: per row up to ROW_SCALES_MAX_ROWS rows, blocks above."""
        small = m <= ROW_SCALES_MAX_ROWS
        chosen = self.rows if (small or self.blocks is None) else self.blocks
        return chosen if chosen is not None else self.blocks


def cublas_block_scales(w: torch.Tensor, w_scale: torch.Tensor, block_n: int, block_k: int) -> CublasScales | None:
    """The scales that let `torch._scaled_mm` (cuBLAS) compute `block_fp8_linear` over `w` `[N, K]`
    with per-row block scales `w_scale` `[N, K / 128]`, or None where the Triton GEMM must serve: blocks
    of K other than 128, K not a multiple of 128 or N of 16 (cuBLAS's FP8 alignment), a PyTorch or
    cuBLAS without block scaling (probed once a device), or `RXF_FP8_BLOCK_GEMM=triton`. The per-row
    form is a transposed copy of `w_scale` (3% of the FP8 weight's bytes), kept where it serves."""
    choice = os.environ.get("RXF_FP8_BLOCK_GEMM", "cublas")
    if choice not in _GEMM_CHOICES:
        raise ValueError(f"RXF_FP8_BLOCK_GEMM={choice!r}: expected one of {', '.join(_GEMM_CHOICES)}")
    n, k = w.shape
    if choice == "triton" or block_k != CUBLAS_BLOCK or k % CUBLAS_BLOCK or n % 16 or not w.is_cuda:
        return None
    kb = k // CUBLAS_BLOCK
    blocks = None
    if choice != "cublas-rows" and block_n == CUBLAS_BLOCK and n % CUBLAS_BLOCK == 0 and kb % 4 == 0:
        grouped = w_scale.view(n // CUBLAS_BLOCK, CUBLAS_BLOCK, kb)
        if torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
            blocks = grouped[:, 0].contiguous()  # [N / 128, K / 128]
    # torch._scaled_mm reads mat_b = w.T [K, N]; its scale_b.T must be [N / 128, K / 128] row-major
    # (128 x 128 blocks) or [N, K / 128] with stride 1 along N (a scale per row and block).
    rows = None if (blocks is not None and choice == "cublas-blocks") else w_scale.t().contiguous()
    for form, square in ((blocks, True), (rows, False)):
        key = (str(w.device), square)
        if form is not None and key not in _cublas_works:
            _cublas_works[key] = _probe(w.device, square)
    blocks = blocks.t() if blocks is not None and _cublas_works[str(w.device), True] else None
    rows = rows if rows is not None and _cublas_works[str(w.device), False] else None
    return None if blocks is None and rows is None else CublasScales(rows, blocks)


def _probe(device: torch.device, square_blocks: bool) -> bool:
    """Whether this PyTorch and cuBLAS run the block-scaled FP8 GEMM on `device` (an error otherwise)."""
    m, n, k = 4, 256, 256
    a = torch.zeros(m, k, device=device).to(FP8)
    b = torch.zeros(n, k, device=device).to(FP8)
    scale_a = torch.ones(k // CUBLAS_BLOCK, m, device=device).t()
    rows = n // CUBLAS_BLOCK if square_blocks else n
    scale_b = torch.ones(rows, k // CUBLAS_BLOCK, device=device).t() if square_blocks else \
        torch.ones(k // CUBLAS_BLOCK, n, device=device)
    try:
        torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as exc:
        logger.info("block-scaled FP8 through torch._scaled_mm unavailable (%s); the Triton GEMM serves", exc)
        return False
    return True


def block_fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_k: int, bias: torch.Tensor | None,
    cublas_scale: CublasScales | None = None, *, gated: bool = False, norm: torch.nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ dequant(w).T + bias` for block-scaled FP8 `w` on CUDA: activations quantized per token
    and group of `block_k`, then cuBLAS's block-scaled GEMM given `cublas_scale`
    (`cublas_block_scales`), else the Triton GEMM. `gated`, `norm`: as `scaled_mm_rows`'."""
    from rxf.plugins.quantization.fp8_kernels import block_scaled_mm

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.shape[0]:  # cuBLAS takes no empty product
        return x.new_empty(*shape[:-1], w.shape[0])
    # cuBLAS wants the activation scales' leading dimension (rows) a multiple of 4 (16 bytes).
    xq, xs = quantized_input(x2, block_k, cublas_scale is not None, gated=gated, norm=norm, residual=residual)
    if cublas_scale is not None:
        scale_b = cublas_scale.pick(x2.shape[0])
        out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale_b, out_dtype=x.dtype)[: x2.shape[0]]
    else:
        out = block_scaled_mm(xq, xs, w, w_scale, block_k, x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], w.shape[0])
