"""Int4 decode batches through maintained libraries' kernels: the peers rxf's int4 GEMV
(`qgemv_row_kernel.py`) is held against, chosen per role by an `RXF_QGEMV` int4 setting (`qgemv.PEERS`):

  torch2 / torch4 / torch8  torch's own int4 GEMM (`torch._weight_int4pack_mm`, "tinygemm", CUDA), its
                            inner k tiles; it computes `(q - 8) * s + o` with `o = (8 - z) * s` rounded to
                            bf16 (`cpu_packing.int4_scales_and_zeros`, the CPU path's table)
  gemlite                   GemLite's Triton GEMV (the `gemlite` package, optional: installed on the GPU
                            machine from a wheel; https://github.com/dropbox/gemlite), `W = q * s + o` with
                            `o = -z * s` in bf16 (its default "fma" form); its tuned table for the H100
                            also serves an H200 (same SM), whose name has none of its own

Each holds a second copy of the codes in its library's layout (the layer keeps rxf's for batches
above MAX_ROWS) and serves bf16 x of 1 to MAX_ROWS rows; so neither is bit-exact to `(q - z) * s`,
and both are opt-in, for `benchmarks/gpu_profile.py --phases qgemv` to time beside rxf's kernels.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch
from torch import nn

from rxf.plugins.models.layers.gemv import MAX_ROWS

logger = logging.getLogger(__name__)


class Peer(Protocol):
    label: str

    def takes(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def build(peer: str, layer: nn.Module, group: int) -> Peer | None:
    """`peer`'s kernel over an int4 layer in rxf's CUDA layout, or None (a shape or dtype it does not take,
    or its package missing: rxf's GEMV then serves, as logged)."""
    from rxf.plugins.quantization.int4 import unpack_int32

    codes = unpack_int32(layer.qweight.data, dim=0)  # [K, N], rxf's order: input 8r + j in nibble j
    k, n = codes.shape
    role = getattr(layer, "gemv_role", "layer")
    if layer.scales.dtype != torch.bfloat16 or group not in (32, 64, 128, 256) or n % 8 or k % 128:
        logger.info("int4 %s: %s takes bf16 layers, groups of 32-256, N a multiple of 8 and K of 128; rxf's GEMV "
                    "serves", role, peer)
        return None
    if peer == "gemlite":
        return _GemLite.build(codes, layer.scales.data, layer.zeros.data, group)
    return _TorchInt4(codes, layer.scales.data, layer.zeros.data, group, int(peer.removeprefix("torch")))


class _Rows:
    """What both peers share: bf16 x of 1 to MAX_ROWS rows of K, the bias added after."""

    label: str
    k: int
    n: int

    def takes(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == torch.bfloat16 and 0 < x.numel() // self.k <= MAX_ROWS

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self._mm(x.reshape(-1, self.k).contiguous())
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.n)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _TorchInt4(_Rows):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 inner_k_tiles: int) -> None:
        from rxf.plugins.quantization.cpu_packing import int4_scales_and_zeros

        self.k, self.n = codes.shape
        self.label, self.group = f"torch{inner_k_tiles}", group
        q = codes.t().to(torch.int32)  # [N, K]; two inputs a byte, the even one in the high nibble
        self.packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous(),
                                                        inner_k_tiles)
        self.table = int4_scales_and_zeros(scales, zeros, group, group)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm(x2, self.packed, self.group, self.table)


class _GemLite(_Rows):
    label = "gemlite"

    def __init__(self, linear: nn.Module, k: int, n: int) -> None:
        self.linear, self.k, self.n = linear, k, n

    @classmethod
    def build(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> _GemLite | None:
        try:
            import gemlite
        except ImportError as e:
            logger.warning("RXF_QGEMV int4=gemlite: gemlite does not import (%s); rxf's GEMV serves", e)
            return None
        _load_tables(gemlite)
        k, n = codes.shape
        linear = gemlite.GemLiteLinearTriton(W_nbits=4, group_size=group, in_features=k, out_features=n,
                                             input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
        linear.pack(codes.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), bias=None)
        return cls(linear, k, n)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return self.linear(x2)


_tables_loaded = False


def _load_tables(gemlite) -> None:
    """GemLite loads the tuned table named in the device's name at import; an H200's name names none,
    so an SM 9.0 device without one takes the H100's (else GemLite autotunes each new shape)."""
    global _tables_loaded
    if _tables_loaded:
        return
    _tables_loaded = True
    from gemlite import core

    if not core.GEMLITE_TRITON_CONFIG_CACHE and torch.cuda.get_device_capability() == (9, 0):
        table = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
        if gemlite.load_config(table):
            logger.info("gemlite: the H100's tuned table for this %s", torch.cuda.get_device_name())
