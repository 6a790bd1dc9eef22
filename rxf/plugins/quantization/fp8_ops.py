"""FP8 (E4M3) weights: quantizing, dequantizing, and the matmuls of an FP8 linear layer.

Scales multiply: `w = w_fp8.float() * scale`. Two weight layouts:
  per row (compressed-tensors per-channel, per-tensor expanded to rows, online FP8): `scale` `[N]`;
  per block (Hugging Face `fp8`, `weight_block_size: [bn, bk]`): `scale` `[N, ceil(K / bk)]`, the
      checkpoint's `[ceil(N / bn), ceil(K / bk)]` repeated over each block's rows at load, so fused
      projections whose sizes are not multiples of bn still hold one row of scales per output row.
Activations are quantized when the layer runs: per token (`[M, 1]` scales) for the per-row layout,
per token and group of bk inputs (`[M, ceil(K / bk)]`) for the block layout, or with a static
per-tensor scale (a checkpoint's `input_scale`). On CUDA the matmuls run in FP8 (`torch._scaled_mm`,
or the block-scaled Triton GEMM of `fp8_kernels.py`); elsewhere layers dequantize at load instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`x @ dequant(w).T + bias` in FP8 on CUDA: `w` `[N, K]` FP8 with float32 row scales `[N]`;
    activations per token (dynamic) or with the static scalar `input_scale`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if input_scale is None:
        xq, xs = quantize_per_token(x2)
    else:
        xq = (x2.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        xs = input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
    out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.reshape(1, -1), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], w.shape[0])


def block_fp8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_k: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ dequant(w).T + bias` for block-scaled FP8 `w` on CUDA: activations quantized per token
    and group of `block_k`, then the block-scaled Triton GEMM."""
    from rxf.plugins.quantization.fp8_kernels import block_scaled_mm

    shape = x.shape
    xq, xs = quantize_per_token(x.reshape(-1, shape[-1]), block_k)
    out = block_scaled_mm(xq, xs, w, w_scale, block_k, x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], w.shape[0])
