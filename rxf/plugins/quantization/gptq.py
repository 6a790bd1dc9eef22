"""`gptq`: AutoGPTQ / GPTQModel checkpoints (int4 weight-only, per group of input features).

`quantization_config`: `{"quant_method": "gptq", "bits": 4, "group_size": 128 (or -1: one group),
"desc_act": false, "sym": true, "checkpoint_format": "gptq"}`. Each projection stores, for K inputs,
N outputs and G = ceil(K / group_size) groups:
  `qweight` int32 `[K / 8, N]`: word `[r, n]` holds inputs 8r..8r+7 of output n, input 8r + j in
      nibble j;
  `qzeros` int32 `[G, N / 8]`: zero points, outputs 8c + j in nibble j of word `[g, c]`;
  `scales` float16 `[G, N]`; `g_idx` int32 `[K]`: each input's group (`k // group_size` unless
      `desc_act`, where the quantizer visited inputs in order of activation size and numbered the
      groups in that order).
`w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]`, where the stored zero is z - 1 in
`checkpoint_format` "gptq" (AutoGPTQ's packer subtracted one; a symmetric checkpoint stores 7 for a
zero of 8) and z itself in "gptq_v2". With `desc_act` and tensor parallelism a row-parallel
layer keeps every group's scales and zeros (its inputs' groups are scattered).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rxf.plugins.models.layers.linear import TensorLayout
from rxf.plugins.quantization.base import config_value
from rxf.plugins.quantization.int4 import Int4Method, Int4Weights, unpack_int32

_HALF = (torch.float16, torch.bfloat16, torch.float32)


class GptqMethod(Int4Method):
    name = "gptq"
    quant_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        assert quant_config is not None  # Int4Method.__init__ refused None
        self.zero_offset = 1 if config_value(quant_config, "checkpoint_format", ("gptq", "gptq_v2"), "gptq") == "gptq" else 0
        self.desc_act = bool(quant_config.get("desc_act", False))
        self.group_size = int(quant_config.get("group_size", 128))
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(f"gptq: quantization_config.group_size = {self.group_size}: -1 or a positive multiple of 8 "
                             "expected")
        self.skipped = tuple(quant_config.get("modules_to_not_convert") or ())

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.out_per_rank, layer.in_per_rank
        full_k = k * layer.tp_size if layer.in_slice() is not None else k
        g = layer.group_size = full_k if self.group_size == -1 else self.group_size  # -1: one group
        # Groups follow the rank's inputs unless act order scatters them (then all are kept).
        split_groups = not self.desc_act and k % g == 0
        groups = k // g if split_groups else -(-full_k // g)
        if n % 8 or k % 8:
            raise ValueError(f"gptq: a layer of {k} inputs and {n} outputs per rank does not fit words of 8")
        group_dim = 0 if split_groups else None
        layer.add_param("qweight", torch.empty(k // 8, n, dtype=torch.int32),
                        TensorLayout(out_dim=1, in_dim=0, in_pack=8, dtypes=(torch.int32,)))
        layer.add_param("qzeros", torch.empty(groups, n // 8, dtype=torch.int32),
                        TensorLayout(out_dim=1, in_dim=group_dim, out_pack=8, in_pack=g, dtypes=(torch.int32,)))
        layer.add_param("scales", torch.empty(groups, n, dtype=torch.float32),
                        TensorLayout(out_dim=1, in_dim=group_dim, in_pack=g, dtypes=_HALF))
        g_idx = layer.add_param("g_idx", torch.empty(k, dtype=torch.int32),
                                TensorLayout(out_dim=None, in_dim=0, dtypes=(torch.int32,)))
        del layer.weight
        load_any = g_idx.weight_loader
        loaded_shards: list[Any] = []

        def load_shared(param: torch.nn.Parameter, loaded: torch.Tensor, *shard: Any) -> None:
            # A fused layer holds one g_idx for its projections, which read the same input and so
            # share their act order; a checkpoint whose projections differ cannot fuse.
            before = param.data.clone() if loaded_shards else None
            load_any(param, loaded, *shard)
            if before is not None and not torch.equal(before, param.data):
                raise ValueError(f"g_idx of shard {shard[0] if shard else ''} differs from shard {loaded_shards[0]}'s; "
                                 "fused projections must share their act order")
            loaded_shards.append(shard[0] if shard else None)

        g_idx.weight_loader = load_shared

    def unpack(self, layer: nn.Module) -> Int4Weights:
        codes = unpack_int32(layer.qweight.data, 0)
        zeros = unpack_int32(layer.qzeros.data, 1).float() + self.zero_offset
        g_idx = layer.g_idx.data.long()
        if layer.scales.shape[0] * layer.group_size == codes.shape[0] and not self.desc_act:
            g_idx = g_idx - g_idx.min()  # this rank's groups only (split like its inputs)
        if int(g_idx.max()) >= layer.scales.shape[0] or int(g_idx.min()) < 0:
            raise ValueError(f"gptq: g_idx names group {int(g_idx.max())}, but the layer has "
                             f"{layer.scales.shape[0]} groups")
        return Int4Weights(codes, zeros, layer.scales.data, g_idx)
