"""`awq`: AutoAWQ's GEMM checkpoints (int4 weight-only, asymmetric, per group of input features).

`quantization_config`: `{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
"version": "gemm", "modules_to_not_convert": [...]}`. Each projection stores, for K inputs and N
outputs and G = K / group_size groups:
  `qweight` int32 `[K, N / 8]`: word `[k, c]` holds outputs 8c..8c+7 of input k, in AWQ's
      interleaved nibble order: output 8c + j in nibble `AWQ_ORDER[j]` = (0, 4, 1, 5, 2, 6, 3, 7)[j]
      (the packer writes outputs 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7);
  `qzeros` int32 `[G, N / 8]`: the zero points, packed the same way;
  `scales` float16 `[G, N]`.
`w[k, n] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]` (no offset on the zero).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rxf.plugins.models.layers.linear import TensorLayout
from rxf.plugins.quantization.base import config_value
from rxf.plugins.quantization.int4 import Int4Method, Int4Weights, unpack_int32

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_HALF = (torch.float16, torch.bfloat16, torch.float32)


class AwqMethod(Int4Method):
    name = "awq"
    quant_params = ("qweight", "qzeros", "scales")

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        assert quant_config is not None  # Int4Method.__init__ refused None
        config_value(quant_config, "zero_point", (True,), "awq")
        config_value({"version": str(quant_config.get("version", "gemm")).lower()}, "version", ("gemm",), "awq")
        self.group_size = int(quant_config.get("group_size", 128))
        if self.group_size <= 0 or self.group_size % 8:
            raise ValueError(f"awq: quantization_config.group_size = {self.group_size}: a positive multiple of 8 expected")
        self.skipped = tuple(quant_config.get("modules_to_not_convert") or ())

    def create_weights(self, layer: nn.Module) -> None:
        n, k, g = layer.out_per_rank, layer.in_per_rank, self.group_size
        layer.group_size = g
        if n % 8 or k % g:
            raise ValueError(f"awq: a layer of {k} inputs and {n} outputs per rank does not fit groups of {g} "
                             "inputs and words of 8 outputs")
        packed = TensorLayout(out_dim=1, in_dim=0, out_pack=8, dtypes=(torch.int32,))
        layer.add_param("qweight", torch.empty(k, n // 8, dtype=torch.int32), packed)
        layer.add_param("qzeros", torch.empty(k // g, n // 8, dtype=torch.int32),
                        TensorLayout(out_dim=1, in_dim=0, out_pack=8, in_pack=g, dtypes=(torch.int32,)))
        layer.add_param("scales", torch.empty(k // g, n, dtype=torch.float32),
                        TensorLayout(out_dim=1, in_dim=0, in_pack=g, dtypes=_HALF))
        del layer.weight

    def unpack(self, layer: nn.Module) -> Int4Weights:
        codes = unpack_int32(layer.qweight.data, 1, AWQ_ORDER)
        zeros = unpack_int32(layer.qzeros.data, 1, AWQ_ORDER).float()
        group_of = torch.arange(codes.shape[0], device=codes.device) // layer.group_size
        return Int4Weights(codes, zeros, layer.scales.data, group_of)
