"""When a quantized layer takes the weight-only decode GEMV (`qgemv_kernel.py`), and its tile sizes.

On CUDA, a linear layer of `fp8` (online or block-wise), `compressed-tensors` FP8, `awq` or `gptq`
whose input is bf16 / fp16 with 1 to `MAX_ROWS` rows after flattening (decode at batch 1-8, or an
extend of that few tokens) runs the GEMV: the weight is read once, in its stored form, and x is not
quantized, even where the checkpoint asks for FP8 activations (the GEMV computes the exact product
with the stored weight, which quantized activations only approximate). Larger batches and float32
models keep the method's GEMM.

Off unless `RXF_QGEMV` (read once per process) names the format. On the H200 the kernel passes
tests/gpu/test_quant_gemv_gpu.py and beats the methods' GEMMs on most projections at 1-8 rows
(`benchmarks/gpu_profile.py --phases qgemv`: one batch-1 step's projections of the Llama-3-8B shape
4.42 -> 3.91 ms for fp8 per row, 4.26 -> 3.01 for fp8-block, 6.51 -> 4.73 for int4 with the
settings it suggests; benchmarks/RESULTS.md, issue 19), yet it streams at 0.6-2.4 TB/s where bf16
cuBLAS reaches ~4, and no end-to-end decode has been compared with it off and on in one call, so
the default waits for that. `RXF_QGEMV` is a comma-separated list of `FORMAT=SETTING` or `FORMAT:ROLE=SETTING` (the role's
entry wins); `auto` takes the format's tile sizes from `DEFAULTS`, with the split over K chosen from
the shape and the SM count (`GemvSettings.resolve`), e.g.

    RXF_QGEMV="int4=n128k128s2st4w4,fp8:gate_up_proj=n64k256s1st4w4,fp8-block:o_proj=off"

Formats: `fp8` (per-row scales: online FP8, compressed-tensors per channel or per tensor),
`fp8-block` (Hugging Face's block-wise FP8), `int4` (AWQ, GPTQ). Roles: the layer's name
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`); other layers take their format's entry. A
setting is `off` (the method's GEMM at every batch size), `auto` (the format's default) or a label
`n{block_n}k{block_k}s{split_k}st{num_stages}w{num_warps}` as `benchmarks/gpu_profile.py --phases
qgemv` prints it (prefix `r`, suffix `p` and split 0 as in `RXF_GEMV`: the row kernel at batch 1, the
weights asked of L2 before the PDL wait, the split chosen from the shape). block_k shrinks to fit the format: to a divisor of K, of the FP8 scale block and of
the int4 group.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
from torch import nn

from rxf.plugins.models.layers.gemv import MAX_ROWS, GemvSettings
from rxf.plugins.models.layers.gemv import ROLES as GEMV_ROLES

logger = logging.getLogger(__name__)

ENV = "RXF_QGEMV"
FORMATS = ("fp8", "fp8-block", "int4")
ROLES = tuple(r for r in GEMV_ROLES if r != "lm_head")  # the quantized methods leave the LM head dense
# Per format: the tile of weight bytes one pipeline stage reads is 16 KB for fp8 (64 x 256) and 8 KB
# for fp8-block (its K tile stops at the 128-input scale block) and int4 (128 x 128 codes).
DEFAULTS = {
    "fp8": GemvSettings(block_n=64, block_k=256, split_k=0, num_stages=4, num_warps=4),
    "fp8-block": GemvSettings(block_n=64, block_k=128, split_k=0, num_stages=4, num_warps=4),
    "int4": GemvSettings(block_n=128, block_k=128, split_k=0, num_stages=4, num_warps=4),
}
_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _plan() -> dict[tuple[str, str | None], GemvSettings | None]:
    plan: dict[tuple[str, str | None], GemvSettings | None] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        key, sep, setting = item.partition("=")
        fmt, _, role = key.partition(":")
        if not sep or fmt not in FORMATS or (role and role not in ROLES):
            raise ValueError(f"{ENV}: {item!r} is not FORMAT=SETTING or FORMAT:ROLE=SETTING with FORMAT one of "
                             f"{', '.join(FORMATS)} and ROLE one of {', '.join(ROLES)}")
        if setting in ("off", "auto"):
            plan[fmt, role or None] = None if setting == "off" else DEFAULTS[fmt]
            continue
        try:
            plan[fmt, role or None] = GemvSettings.parse(setting)
        except ValueError as e:
            raise ValueError(f"{ENV}: {key}: {setting!r} is not 'off', 'auto' or a label like n64k256s2st4w4 "
                             f"({e})") from None
    return plan


def settings_for(fmt: str, role: str | None) -> GemvSettings | None:
    """The settings `RXF_QGEMV` gives `fmt` layers named `role` (None: off)."""
    plan = _plan()
    for key in ((fmt, role), (fmt, None)):
        if key in plan:
            return plan[key]
    return None  # off unless asked for: see the module docstring


class QuantGemv:
    """One quantized layer's decode GEMV: its weight tensors as the kernel reads them, the resolved
    settings, and the split-K counters (allocated with the layer at load, so never inside a CUDA-graph
    capture; every launch leaves them zeroed). `scale_k`: the inputs one scale covers (the FP8 block,
    the int4 group; K for per-row scales); `scale_rows`: the output rows one block scale covers."""

    def __init__(
        self, fmt: str, settings: GemvSettings, weight: torch.Tensor, scales: torch.Tensor,
        zeros: torch.Tensor | None = None, *, scale_k: int, scale_rows: int = 1,
    ) -> None:
        from rxf.plugins.quantization import qgemv_kernel

        self.kind = {"fp8": qgemv_kernel.FP8_ROWS, "fp8-block": qgemv_kernel.FP8_BLOCKS, "int4": qgemv_kernel.INT4}[fmt]
        int4 = self.kind == qgemv_kernel.INT4
        self.n, self.k = (weight.shape[1], weight.shape[0] * 8) if int4 else weight.shape
        self.weight, self.scales, self.zeros = weight, scales, zeros
        self.scale_k, self.scale_rows = scale_k, scale_rows
        fitted = dataclasses.replace(settings, block_k=min(settings.block_k, scale_k & -scale_k))
        self.settings = fitted.resolve(self.n, self.k, weight.device)  # ValueError: no tile fits K
        self.counters = torch.zeros(-(-self.n // self.settings.block_n), dtype=torch.int32, device=weight.device)

    def takes(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype in _HALF and 0 < x.numel() // self.k <= MAX_ROWS

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from rxf.plugins.quantization.qgemv_kernel import qgemv

        x2 = x.reshape(-1, self.k)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        s = self.settings
        out = qgemv(x2, self.kind, self.weight, self.scales, self.zeros, bias, self.counters,
                    scale_rows=self.scale_rows, scale_k=self.scale_k, block_n=s.block_n, block_k=s.block_k,
                    split_k=s.split_k, num_stages=s.num_stages, num_warps=s.num_warps, row=s.row,
                    prefetch=s.prefetch)
        return out.reshape(*x.shape[:-1], self.n)


def _build(layer: nn.Module, fmt: str, *tensors: torch.Tensor | None, **kw: int) -> QuantGemv | None:
    role = getattr(layer, "gemv_role", None)
    settings = settings_for(fmt, role)
    if settings is None:
        return None
    try:
        return QuantGemv(fmt, settings, *tensors, **kw)
    except ValueError as e:  # a K with no power-of-two tile >= 16 (e.g. 8 x an odd number)
        logger.info("%s %s: no decode GEMV (%s); the method's GEMM serves every batch", fmt, role or "layer", e)
        return None


def fp8_rows(layer: nn.Module) -> QuantGemv | None:
    """The GEMV of an FP8 layer with float32 row scales `weight_scale` `[N]`, or None (off)."""
    return _build(layer, "fp8", layer.weight, layer.weight_scale, scale_k=layer.weight.shape[1])


def fp8_blocks(layer: nn.Module, block_n: int, block_k: int) -> QuantGemv | None:
    """The GEMV of a block-wise FP8 layer (`weight_scale_inv` `[N, ceil(K / block_k)]`, one row of
    block scales per output row, `fp8_ops`). Where each run of block_n rows holds the same scales
    (fused projections whose sizes are multiples of block_n), the kernel reads the checkpoint's
    `[N / block_n, ...]` table instead: one scale per block, not one per row."""
    scales = layer.weight_scale_inv.data
    n = scales.shape[0]
    rows = 1
    if n % block_n == 0:
        blocks = scales.view(n // block_n, block_n, -1)
        if torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
            scales, rows = blocks[:, 0].contiguous(), block_n
    return _build(layer, "fp8-block", layer.weight, scales, scale_k=block_k, scale_rows=rows)


def int4(layer: nn.Module, group_size: int) -> QuantGemv | None:
    """The GEMV of an int4 layer in rxf's CUDA layout (`int4.py`), or None (off, or zeros that are
    not integers in [0, 128), which the kernel's exact half-precision `code - zero` needs)."""
    zeros = layer.zeros.data
    if not (torch.equal(zeros, zeros.round()) and bool(((zeros >= 0) & (zeros < 128)).all())):
        logger.info("int4: zero points that are not integers in [0, 128): no decode GEMV")
        return None
    return _build(layer, "int4", layer.qweight, layer.scales, zeros, scale_k=group_size)
