"""MXFP4 (OCP microscaling FP4) weights, dequantized at load: gpt-oss ships its experts this way.

A checkpoint stores a weight `[..., rows, cols]` as two tensors:
  `*_blocks` uint8 `[..., rows, cols / 32, 16]`: 32 FP4 (E2M1) codes per block, two per byte, the
      low nibble first (element 2i in bits 0-3, element 2i + 1 in bits 4-7);
  `*_scales` uint8 `[..., rows, cols / 32]`: one E8M0 exponent per block, biased by 127.
Element value = FP4_VALUES[code] * 2 ** (scale - 127). FP4 values times a power of two are exact in
bfloat16 and float32 (a 1-bit mantissa), so dequantizing to either loses nothing; float16 overflows
where the scale leaves its range, as in any reader of these checkpoints.
"""

from __future__ import annotations

import torch

# E2M1 codes 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., rows, cols]` in `dtype`, on the blocks' device, from `blocks` `[..., rows, G, 16]` and
    `scales` `[..., rows, G]` (cols = 32 G)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: "
            f"blocks must be scales' shape plus a last dimension of {BLOCK // 2}"
        )
    scales = scales.to(blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], element order
    values = lut[codes.long()] * torch.exp2(scales.float() - SCALE_BIAS).unsqueeze(-1)
    return values.flatten(-2).to(dtype)
