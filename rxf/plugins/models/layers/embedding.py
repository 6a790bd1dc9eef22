"""Token embedding and the logits head, vocab-parallel across tensor-parallel ranks.

Both hold this rank's rows of the `[vocab, hidden]` weight: the vocabulary is padded up to a
multiple of tp_size and rank r holds ids [r * shard, (r + 1) * shard); padding rows are zero and
their logits are cut off after the gather. When a checkpoint ties the two, the model makes the head
share the embedding's Parameter (same sharding), so one tensor is loaded and `named_parameters()`
lists it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rxf.core.quantization import QuantizationMethod
from rxf.core.runner import distributed
from rxf.plugins.models.layers.gemv import DecodeGemv, decode_gemv
from rxf.plugins.models.layers.linear import copy_weight, resolve_tp
from rxf.plugins.quantization import cpu_packing


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = resolve_tp(tp_size, tp_rank)
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        # Real (unpadded) ids of this rank: [vocab_start, vocab_start + num_real).
        self.num_real = max(0, min(self.shard_size, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"{type(self).__name__}: checkpoint has {loaded.shape[0]} rows, the vocabulary {self.vocab_size}"
            )
        copy_weight(param.data[: self.num_real], loaded.narrow(0, self.vocab_start, self.num_real), type(self).__name__)
        param.data[self.num_real :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce adds the owner's row.
        local = input_ids - self.vocab_start
        foreign = (local < 0) | (local >= self.num_real)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        out.masked_fill_(foreign.unsqueeze(-1), 0)
        return distributed.tp_all_reduce(out)


class LogitsHead(VocabEmbedding):
    """hidden `[n, hidden]` -> float32 logits `[n, vocab]` (every rank gets all of them). Only the
    rows whose logits are returned should reach it: the vocab projection is the widest matmul of a
    decode step. `use_decode_gemv()`: small CUDA batches through the Triton GEMV where `layers/gemv.py`
    gives `lm_head` one (by default on Hopper), writing float32 directly at tp_size 1 (no separate cast)."""

    gemv: DecodeGemv | None = None
    # A quantization method may serve the head once its dense weight is loaded (`after_load` in
    # rxf.core.quantization); the weight itself stays, for the embedding it may be tied to.
    quantize_after_load = True
    quant: QuantizationMethod | None = None
    # Set by the CUDA-graph runner around a capture (`cuda_graph_runner`): float32 rows `[n, vocab]` of
    # the one buffer every captured batch size's logits share, which the head then writes, instead of
    # each graph keeping logits of its own (19 GB over the buckets up to 768 rows of a 128k vocabulary).
    graph_output: torch.Tensor | None = None
    packed_weight: torch.Tensor | None = None  # oneDNN's copy of the weight (`pack_for_device`)
    plain_weight: torch.Tensor | None = None  # the weight, for the few-row kernel (`cpu_packing`)
    upcast_min_rows: int | None = None  # emulated bf16: batches this large run in float32 (`cpu_packing`)

    def use_decode_gemv(self) -> None:
        self.gemv = decode_gemv("lm_head", self.weight, out_dtype=torch.float32 if self.tp_size == 1 else None)

    def pack_for_device(self) -> None:
        """After loading: a bf16 CPU head computes from a copy of its weight in oneDNN's packed layout
        (`cpu_packing`; 2.4x faster at one row for the demo's 49152 x 576 head). A copy: the
        weight itself may be the embedding's, which looks rows up."""
        if cpu_packing.emulated_bf16(self.weight):
            self.upcast_min_rows = cpu_packing.HEAD_UPCAST_MIN_ROWS
        elif cpu_packing.dense_packable(self.weight):
            self.packed_weight = cpu_packing.pack_dense(self.weight.data)
            self.plain_weight = self.weight.data if cpu_packing.keeps_plain_weight() else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.graph_output
        if out is not None and out.shape != (hidden.shape[0], self.vocab_size):
            out = None  # rows the buffer does not match: logits of their own, as without it
        if self.quant is not None:
            logits = self.quant.apply(self, hidden, None)
        elif self.packed_weight is not None:
            logits = cpu_packing.dense_linear(hidden, self.packed_weight, self.plain_weight, None)
        elif self.upcast_min_rows is not None and hidden.shape[0] >= self.upcast_min_rows:
            logits = cpu_packing.upcast_linear(hidden, self.weight, None, torch.float32)
        elif self.gemv is not None and self.gemv.applies(hidden):  # float32 at tp_size 1: straight into out
            logits = self.gemv(hidden, self.weight, None, out if self.tp_size == 1 else None)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:  # gathered in the model's dtype (half the traffic of float32 for bf16)
            logits = distributed.tp_all_gather(logits, dim=-1)[:, : self.vocab_size].contiguous()
        if out is None:
            return logits.float()
        if logits is not out:
            out.copy_(logits)  # the cast to float32 `.float()` would make, into the shared rows
        return out
