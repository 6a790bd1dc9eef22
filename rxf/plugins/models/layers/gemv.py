"""Which decode projections use rxf's Triton GEMV (`gemv_kernel.py`) instead of cuBLAS, and how.

The choice is made per projection role from measurements (`benchmarks/gpu_profile.py --phases gemv`
times every candidate against cuBLAS on the GPU) and given in the environment variable `RXF_GEMV`,
read once per process: a comma-separated list of `role=setting`, e.g.

    RXF_GEMV="qkv_proj=n32k256s2st4w4,o_proj=n32k256s4st4w4,gate_up_proj=cublas"

Roles: `qkv_proj`, `o_proj`, `gate_up_proj` (the GEMV then also applies SiLU·mul, one launch),
`down_proj`, `lm_head` (then writes float32 logits directly). A setting without a role (`RXF_GEMV=cublas`)
is every role's unless the list names that role too. A setting is `cublas`, `triton` (default tile sizes,
split over K to fill the GPU), or a label
`n{block_n}k{block_k}s{split_k}st{num_stages}w{num_warps}` as the benchmark prints it (prefix `r`: batch 1
through the row kernel, `gemv_row_kernel.py`, and larger batches through the tl.dot one at `triton`'s
settings; split 0: chosen from the shape as `triton` does). The GEMV runs
only on CUDA, in bf16 or fp16, for at most `MAX_ROWS` rows (decode at batch 1-8, or an extend of that few tokens);
larger batches keep cuBLAS.

A role the variable leaves out gets `triton` on Hopper (compute capability 9.x: the H100 and H200, where
it was measured: with programmatic dependent launch, `rxf/core/runner/pdl.py`, batch-1 decode of the
Llama-3-8B, Qwen3-30B-A3B and Qwen3-8B shapes ran 5.3%, 5.9% and 8.9% faster than on cuBLAS without it,
batches of 4 and 8 1-8% faster; benchmarks/RESULTS.md 2026-12-06), or there the label `SHAPE_DEFAULTS`
holds for its weight's shape, and `cublas` on other GPUs, whose tiles nobody has measured. Such a
default serves inside CUDA graphs only: an eager step is bound by its host time, and each Triton
launch costs ~60 us of it (Triton's Python launcher) against ~23 us for a cuBLAS call (cProfile, an
H100, benchmarks/RESULTS.md "Eager decode on an H100"). A setting `RXF_GEMV` names serves eager
steps too.

The norm before a pre-norm block's projection runs as its own launch: taken into the GEMV it was
slower (`gemv_kernel`'s docstring).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch

ROLES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
MAX_ROWS = 8  # batch sizes the GEMV serves; the kernel's tile holds up to 16 rows
ENV = "RXF_GEMV"
_HALF = (torch.bfloat16, torch.float16)
_LABEL = re.compile(r"(r?)n(\d+)k(\d+)s(\d+)st(\d+)w(\d+)")
# Programs wanted per SM when split 0 picks the split itself: enough weight tiles in flight. The row
# kernels hold one tile ahead in registers (no pipeline), so they want more programs: the quantized
# ones' sweep (H200, 2026-12-05, benchmarks/RESULTS.md) chose twice the split of 2 a SM at most shapes.
_PROGRAMS_PER_SM = 2
_ROW_PROGRAMS_PER_SM = 5


@dataclass(frozen=True)
class GemvSettings:
    block_n: int = 32  # output columns per program
    block_k: int = 256  # K per pipelined tile
    split_k: int = 0  # programs along K (0: chosen from the shape and the SM count)
    num_stages: int = 4
    num_warps: int = 4
    row: bool = False  # batch 1 through `gemv_row_kernel` (no tl.dot, no shared memory); label prefix "r"

    @property
    def label(self) -> str:
        return f"{'r' if self.row else ''}n{self.block_n}k{self.block_k}s{self.split_k}st{self.num_stages}w{self.num_warps}"

    @classmethod
    def parse(cls, text: str) -> GemvSettings:
        match = _LABEL.fullmatch(text)
        if match is None:
            raise ValueError(f"{text!r} is not 'cublas', 'triton' or a label like n32k256s4st4w4 or rn16k512s2st1w4")
        row = match.group(1) == "r"
        block_n, block_k, split_k, stages, warps = map(int, match.groups()[1:])
        for name, value in (("block_n", block_n), ("block_k", block_k)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{text!r}: {name} {value} is not a power of two >= 16")
        if split_k < 0 or stages < 1 or warps not in (1, 2, 4, 8):
            raise ValueError(f"{text!r}: split_k must be >= 0 (0: chosen from the shape), stages >= 1 and warps "
                             "1, 2, 4 or 8")
        return cls(block_n, block_k, split_k, stages, warps, row)

    def resolve(self, n_out: int, k: int, device: torch.device) -> GemvSettings:
        """With split_k 0: the split that gives about _PROGRAMS_PER_SM programs per SM (the row kernel:
        _ROW_PROGRAMS_PER_SM), at most one K tile per program; block_k shrinks to a divisor of K if
        needed."""
        block_k = self.block_k
        while k % block_k:
            block_k //= 2
        if block_k < 16:
            raise ValueError(f"K {k} has no power-of-two divisor >= 16 for the GEMV")
        split_k = self.split_k
        if split_k == 0:
            sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            n_blocks = -(-n_out // self.block_n)
            per_sm = _ROW_PROGRAMS_PER_SM if self.row else _PROGRAMS_PER_SM
            split_k = max(1, min(-(-per_sm * sms // n_blocks), k // block_k))
        return GemvSettings(self.block_n, block_k, split_k, self.num_stages, self.num_warps, self.row)


_BY_DEVICE = "by device"  # a role the variable leaves out: `device_default` decides
# Settings measured faster than `triton`'s for a weight shape [N, K] (half precision, Hopper), by the
# H100's sweeps (`gpu_profile.py --phases gemv`), each set then measured end to end at batch 1 against
# `triton` (benchmarks/RESULTS.md, 2026-12-06): Qwen3-30B-A3B's qkv, o_proj and lm_head (279.0 -> 283.2
# tok/s; 307.3 -> 313.2 on the later kernels of that day), Qwen3-8B's gate_up, down and lm_head (170.8
# -> 174.0). Llama-3-8B's shapes keep `triton`: its sweep's picks were slower end to end.
SHAPE_DEFAULTS = {
    (5120, 2048): "rn16k256s2st2w4", (2048, 4096): "rn16k512s2st2w8", (151936, 2048): "rn16k256s1st2w4",
    (24576, 4096): "rn16k256s1st2w4", (4096, 12288): "n64k256s2st4w4", (151936, 4096): "n64k256s1st4w4",
}


def device_default(shape: tuple[int, int], dtype: torch.dtype, hopper: bool) -> GemvSettings | None:
    """The setting a role that `RXF_GEMV` leaves out gets for a weight of this shape and dtype: on Hopper
    `SHAPE_DEFAULTS`' label or `triton`'s tiles (half precision only), elsewhere cuBLAS (None)."""
    if not hopper or dtype not in _HALF:
        return None
    label = SHAPE_DEFAULTS.get(tuple(shape))
    return GemvSettings.parse(label) if label else GemvSettings()


def _setting(text: str) -> GemvSettings | None:
    return None if text == "cublas" else GemvSettings() if text == "triton" else GemvSettings.parse(text)


@functools.cache
def _from_env() -> dict[str, GemvSettings | None | str]:
    items = [part.strip() for part in os.environ.get(ENV, "").split(",") if part.strip()]
    plan: dict[str, GemvSettings | None | str] = dict.fromkeys(ROLES, _BY_DEVICE)
    for item in sorted(items, key=lambda item: "=" in item):  # a bare setting first: roles named override it
        role, sep, setting = item.partition("=")
        if sep and role not in ROLES:
            raise ValueError(f"{ENV}: {item!r} is not SETTING or ROLE=SETTING with ROLE one of {', '.join(ROLES)}")
        try:
            value = _setting(setting if sep else item)
        except ValueError as e:
            raise ValueError(f"{ENV}: {role if sep else 'every role'}: {e}") from None
        plan.update({role: value} if sep else dict.fromkeys(ROLES, value))
    return plan


class DecodeGemv:
    """One projection's GEMV: resolved settings, the epilogue, and the split-K counters (allocated on
    `device` at model construction, so never inside a CUDA-graph capture)."""

    def __init__(
        self, settings: GemvSettings, weight: torch.Tensor, *, gated: bool = False,
        out_dtype: torch.dtype | None = None, graphs_only: bool = False,
    ) -> None:
        n, k = weight.shape
        n_out = n // 2 if gated else n
        self.settings = settings.resolve(n_out, k, weight.device)
        # A row setting serves one row of x; more rows take the tile kernel at `triton`'s settings (a row
        # label's own tile parameters, one or two stages, starve tl.dot's pipeline).
        self.tile = GemvSettings().resolve(n_out, k, weight.device) if self.settings.row else self.settings
        self.gated, self.out_dtype, self.graphs_only = gated, out_dtype, graphs_only
        blocks = max(-(-n_out // s.block_n) for s in (self.settings, self.tile))
        self.counters = torch.zeros(blocks, dtype=torch.int32, device=weight.device)

    def applies(self, x: torch.Tensor) -> bool:
        # Half precision only: the settings are tuned (and sized for shared memory) for 2-byte tiles;
        # a float32 model's tiles are twice as large (n64k256 with 4 stages needs 240 KB, over the
        # H200's 227 KB) and its decode keeps cuBLAS. `graphs_only`: inside a CUDA-graph capture only.
        return (x.is_cuda and x.dtype in _HALF and x.dim() == 2 and x.shape[0] <= MAX_ROWS
                and x.stride(-1) == 1 and (not self.graphs_only or torch.cuda.is_current_stream_capturing()))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        from rxf.plugins.models.layers.gemv_kernel import gemv

        s = self.settings if x.shape[0] == 1 else self.tile
        return gemv(x, weight, bias, self.counters, s.block_n, s.block_k, s.split_k, s.num_stages, s.num_warps,
                    gated=self.gated, out_dtype=self.out_dtype, row=s.row, out=out)


def decode_gemv(
    role: str, weight: torch.Tensor, *, gated: bool = False, out_dtype: torch.dtype | None = None
) -> DecodeGemv | None:
    """The GEMV `RXF_GEMV` (or the device, where it leaves `role` out) gives `role` over `weight`, or
    None (cuBLAS)."""
    if role not in ROLES:
        raise ValueError(f"unknown GEMV role {role!r} (roles: {', '.join(ROLES)})")
    settings = _from_env()[role]
    by_device = settings is _BY_DEVICE
    if by_device:
        hopper = weight.is_cuda and torch.cuda.get_device_capability(weight.device)[0] == 9
        settings = device_default(tuple(weight.shape), weight.dtype, hopper)
    if settings is None:
        return None
    return DecodeGemv(settings, weight, gated=gated, out_dtype=out_dtype, graphs_only=by_device)
