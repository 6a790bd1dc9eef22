"""Dense linear layers on the CPU through oneDNN, with each weight packed once after loading.

`F.linear` on CPU tensors hands oneDNN / MKL the plain `[N, K]` weight on every call, and at the
few rows of a decode step that costs half the speed: on the 2-core AVX512-BF16 machine, one row
through SmolLM2-135M's projections ran at 10-15 GB/s of weight in bf16, against 25-36 GB/s with the
weight packed into oneDNN's blocked layout once (gate_up 3072 x 576: 237 -> 126 us; the 49152-row
head: 3.7 -> 1.6 ms; float32 1.2-2.5x at 1-512 rows; bf16 still 1.05x at 512; results equal to
F.linear's in bf16 at one row, `/tmp` microbenchmark recorded in benchmarks/RESULTS.md).
`torch.ops.mkldnn._reorder_linear_weight(w, rows_hint)` packs (an opaque mkldnn tensor) and
`torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")` multiplies: the pair
torch.compile's CPU weight-freezing pass emits.

Packed where oneDNN runs the dtype natively (float32 always, bf16 on CPUs with AVX512-BF16 or AMX);
`RXF_CPU_WEIGHT_PACKING=0` (read at each load, as `rxf.plugins.quantization.cpu_packing`) keeps
F.linear on the plain weight.
"""

from __future__ import annotations

import os

import torch

ENV = "RXF_CPU_WEIGHT_PACKING"
_ROWS_HINT = 1  # the layout oneDNN is asked to favour: decode's one row per request


def packs(weight: torch.Tensor) -> bool:
    """Whether `weight` (a loaded dense `[N, K]` weight) is packed for oneDNN."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.is_mkldnn or os.environ.get(ENV, "1") == "0":
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ROWS_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` for the packed W (x of any leading shape, in W's dtype)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
