"""Int4 decode batches through a maintained library's kernel: the peer rxf's int4 GEMV
(`qgemv_row_kernel.py`) is held against, chosen per role by an `RXF_QGEMV` int4 setting (`qgemv.PEERS`):
`torch2` / `torch4` / `torch8`, torch's own int4 GEMM (`torch._weight_int4pack_mm`, "tinygemm", CUDA)
at those inner k tiles. It computes `(q - 8) * s + o` with `o = (8 - z) * s` rounded to bf16
(`cpu_packing.int4_scales_and_zeros`, the CPU path's table), so it is not bit-exact to `(q - z) * s`,
and it holds a second copy of the codes in its layout (the layer keeps rxf's for batches above
its 16 rows): opt-in. Measured (H100, 2026-12-05, benchmarks/RESULTS.md): at one row it matches rxf's
row GEMV (Llama-3-8B's qkv / o_proj 5-17% faster, gate_up / down 7-12% slower; AWQ batch 1 319.4
tok/s with rxf's kernels, 321.8 with torch8 everywhere, 325.9 with torch4 / torch8 for qkv / o_proj);
at 2-4 rows it took 1.4-2.3x less time than rxf's int4 tile GEMV, at 8 rows 0.97-1.4x, at 16 rows
1.1-1.4x more except on o_proj (H100, the same day, the tile's dot per nibble position). GemLite's Triton GEMV (0.6.0.post2) was timed as a
peer too and removed: 1.8-3.6% off the dequantized product and slower than both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from rxf.plugins.models.layers.gemv_kernel import ROWS

logger = logging.getLogger(__name__)


def build(peer: str, layer: nn.Module, group: int) -> TorchInt4Gemv | None:
    """`peer`'s kernel over an int4 layer in rxf's CUDA layout, or None (a shape or dtype it does not take:
    rxf's GEMV then serves, as logged)."""
    from rxf.plugins.quantization.int4 import unpack_int32

    codes = unpack_int32(layer.qweight.data, dim=0)  # [K, N], rxf's order: input 8r + j in nibble j
    k, n = codes.shape
    role = getattr(layer, "gemv_role", "layer")
    if layer.scales.dtype != torch.bfloat16 or group not in (32, 64, 128, 256) or n % 8 or k % 128:
        logger.info("int4 %s: %s takes bf16 layers, groups of 32-256, N a multiple of 8 and K of 128; rxf's GEMV "
                    "serves", role, peer)
        return None
    return TorchInt4Gemv(codes, layer.scales.data, layer.zeros.data, group, int(peer.removeprefix("torch")))


class TorchInt4Gemv:
    """torch's int4 GEMM over one layer's codes: bf16 x of 1 to ROWS (16) rows of K, the bias added after."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 inner_k_tiles: int) -> None:
        from rxf.plugins.quantization.cpu_packing import int4_scales_and_zeros

        self.k, self.n = codes.shape
        self.label, self.group = f"torch{inner_k_tiles}", group
        q = codes.t().to(torch.int32)  # [N, K]; two inputs a byte, the even one in the high nibble
        self.packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous(),
                                                        inner_k_tiles)
        self.table = int4_scales_and_zeros(scales, zeros, group, group)

    def takes(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == torch.bfloat16 and 0 < x.numel() // self.k <= ROWS

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch._weight_int4pack_mm(x.reshape(-1, self.k).contiguous(), self.packed, self.group, self.table)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.n)
