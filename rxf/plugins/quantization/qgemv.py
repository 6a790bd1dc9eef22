"""When a quantized layer takes the weight-only decode GEMV (`qgemv_kernel.py`), and its tile sizes.

On CUDA, a linear layer of `fp8` (online or block-wise), `compressed-tensors` FP8, `awq` or `gptq`
whose input is bf16 / fp16 with 1 to `MAX_ROWS` rows after flattening (int4: 1 to 16, the tile's
rows; decode at batch 1-8 or 1-16, or an extend of that few tokens) runs the GEMV: the weight is read
once, in its stored form, and x is not quantized, even where the checkpoint asks for FP8 activations
(the GEMV computes the exact product with the stored weight, which quantized activations only
approximate). Larger batches and float32 models keep the method's GEMM.

Which formats take it without `RXF_QGEMV` (read once per process): `BY_DEFAULT`, i.e. every format at
batch 1 through the row kernel (word-wise dequantization, `qgemv_row_kernel.py`), and int4 at 2-16 rows
through the tile kernel too; on sm_90, layers of a shape in `SHAPE_DEFAULTS` take the settings measured
best there. On the H200 (2026-12-05/06, benchmarks/RESULTS.md, issue 19), Llama-3-8B at batch 1 with
those settings decoded at 345.1 tok/s in online FP8, 338.1-343.2 in block-wise FP8 and 384.4 in AWQ,
against 218.1-220.4 in bf16 (before: the method's `torch._scaled_mm` and int4 GEMM gave ~1.0x and 0.74x
of bf16; block-wise FP8 with `BY_DEFAULT`'s split 295.3); on an H100, AWQ with the 4-warp int4
default 298.8 against 169.8. At
2-8 rows (H100, 2026-12-05, the tile kernel's dot per nibble position) the int4 tile kernel took
1.1-1.7x less time than the int4 GEMM at every projection, and at 16 rows as much summed over the four
(204.5 against 205.9 us: qkv and gate_up ahead, o_proj and down 11% behind), while the FP8 tile kernel
lost to `_scaled_mm` on gate_up, so FP8 keeps the GEMM there. `RXF_QGEMV` is a comma-separated list of
`FORMAT=SETTING` or `FORMAT:ROLE=SETTING` (the role's entry wins); `auto` takes the format's tile
sizes from `DEFAULTS`, with the split over K chosen from the shape and the SM count
(`GemvSettings.resolve`), e.g.

    RXF_QGEMV="int4=n128k128s2st4w4,fp8:gate_up_proj=n64k256s1st4w4,fp8-block:o_proj=off"

Formats: `fp8` (per-row scales: online FP8, compressed-tensors per channel or per tensor),
`fp8-block` (Hugging Face's block-wise FP8), `int4` (AWQ, GPTQ). Roles: the layer's name
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`); other layers take their format's entry. A
setting is `off` (the method's GEMM at every batch size), `auto` (the format's tile defaults, 1-8
rows) or a label `n{block_n}k{block_k}s{split_k}st{num_stages}w{num_warps}` as
`benchmarks/gpu_profile.py --phases qgemv` prints it (prefix `r` and split 0 as in `RXF_GEMV`: the
row kernel at batch 1, the tile kernel at the format's `DEFAULTS` for 2-8 rows; the split chosen
from the shape; a row label's `st` is the weight tiles it reads ahead, 1 or 2; prefix `x`, FP8
formats and tile labels only: x is quantized to E4M3 per row and K
tile and the tile kernel's dot runs FP8 x FP8 on the tensor cores, as the methods' own GEMMs
quantize x; prefix `t`, FP8 formats and row labels only: batch 1 reads the weight tiles by TMA into a
pipeline of `st` stages in shared memory, `qgemv_tma_kernel.py`, on sm_90 and later), or, for int4
only, a library peer (`PEERS`, `int4_peers.py`: torch's own int4 GEMM `torch2` / `torch4` /
`torch8`) for bf16 layers at 1-8 rows. block_k shrinks to fit the format: to a divisor of K, of
the FP8 scale block and of the int4 group.
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
from rxf.plugins.models.layers.gemv_kernel import ROWS as TILE_ROWS
from rxf.plugins.quantization import int4_peers

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
# int4 settings that name a maintained library's kernel instead of rxf's (`int4_peers.py`).
PEERS = ("torch2", "torch4", "torch8")


@dataclasses.dataclass(frozen=True)
class QuantSettings:
    """A format's GEMV settings as `RXF_QGEMV` gives them: the tiles, whether x is quantized to FP8
    (label prefix `x`), whether an FP8 row label's tiles come by TMA (prefix `t`,
    `qgemv_tma_kernel.py`: `st` is then the pipeline's stages, 2 or more), or (int4) a library peer's
    kernel in place of rxf's (`PEERS`)."""

    tiles: GemvSettings
    fp8_x: bool = False
    peer: str = ""  # one of PEERS, or rxf's kernels
    tma: bool = False

    @property
    def label(self) -> str:
        if self.peer:
            return self.peer
        return ("x" if self.fp8_x else "") + ("t" if self.tma else "") + self.tiles.label

    @classmethod
    def parse(cls, text: str, fmt: str) -> QuantSettings:
        if text in PEERS:
            if fmt != "int4":
                raise ValueError(f"{text!r}: the library peers serve int4 only")
            return cls(DEFAULTS[fmt], peer=text)
        fp8_x = text.startswith("x")
        tma = text.startswith("t")
        tiles = GemvSettings.parse(text[fp8_x or tma:])
        if fp8_x and (fmt == "int4" or tiles.row):
            raise ValueError(f"{text!r}: prefix x takes an FP8 format's tile label (no r)")
        if tma and (fmt == "int4" or not tiles.row or tiles.num_stages < 2):
            raise ValueError(f"{text!r}: prefix t takes an FP8 format's row label (r) of 2 stages or more")
        return cls(tiles, fp8_x, tma=tma)


# Formats the GEMV serves when `RXF_QGEMV` does not name them: (settings, the most rows they take;
# more rows keep the method's GEMM). The module docstring gives the measurements behind each.
BY_DEFAULT = {
    "fp8": (QuantSettings(GemvSettings(block_n=32, block_k=256, split_k=0, num_stages=1, num_warps=4, row=True)), 1),
    "fp8-block": (QuantSettings(GemvSettings(block_n=64, block_k=128, split_k=0, num_stages=1, num_warps=4, row=True)),
                  1),
    "int4": (QuantSettings(GemvSettings(block_n=128, block_k=128, split_k=0, num_stages=1, num_warps=2, row=True)),
             TILE_ROWS),
}
# Row settings measured best end to end on the H200 for Llama-3-8B's projection shapes (fmt, N, K),
# where `BY_DEFAULT` leaves them (benchmarks/RESULTS.md, 2026-12-05/06): on sm_90 they replace the
# format's default for a layer of that shape, unless `RXF_QGEMV` names the format. Block-wise FP8 at
# batch 1: 338.1 tok/s with these against 295.3 with `BY_DEFAULT` (bf16 218.1, same call); a kernel
# sweep's fastest labels one by one gave 309.7 (the step does not follow standalone times under PDL).
# AWQ with these and int4's default elsewhere (2 warps): 384.4 against 338.3 with the 4-warp default.
# Block-wise FP8 qkv at split 5 (480 programs, one wave of the 4 a SM its 121 registers allow, where 6
# gave 576) and gate_up on TMA tiles (`qgemv_tma_kernel`): against the commit before them in one call
# on an H100, 287.2 tok/s against 280.1 (bf16 176.8: 1.625x; 2026-12-07, RESULTS.md).
SHAPE_DEFAULTS = {
    ("fp8", 6144, 4096): "rn32k256s4st1w4", ("fp8", 4096, 4096): "rn32k256s6st1w4",
    ("fp8", 28672, 4096): "rn32k256s2st1w4", ("fp8", 4096, 14336): "rn32k256s6st1w4",
    ("fp8-block", 6144, 4096): "rn64k128s5st1w4", ("fp8-block", 4096, 4096): "rn64k128s10st1w4",
    ("fp8-block", 28672, 4096): "trn32k128s1st4w4", ("fp8-block", 4096, 14336): "rn64k128s10st1w8",
    ("int4", 4096, 4096): "rn128k128s18st1w4", ("int4", 28672, 4096): "rn64k128s4st1w4",
}
# Formats whose row GEMV (batch 1) of a gate/up layer computes the SiLU·mul after it in its own launch
# (`QuantGemv.activated`), unless `RXF_QGEMV_GATED` lists others (comma-separated; "none": no format).
# On an H100 (2026-12-06, benchmarks/RESULTS.md) AWQ Llama-3-8B at batch 1 went 337.9 -> 350.5 tok/s
# with it, block-wise FP8 267.5 -> 245.8: FP8 keeps the separate launch.
GATED_ENV = "RXF_QGEMV_GATED"
GATED_BY_DEFAULT = ("int4",)
# The most rows an `RXF_QGEMV` entry serves: FP8 formats up to MAX_ROWS, as the dense GEMV; int4 the
# tile kernel's whole 16-row tile, against which its alternative, the int4 GEMM (`int4_kernel.py`,
# an int-to-float conversion per code), lost at 2-8 rows and drew level at 16 (the module docstring).
_MOST_ROWS = {"fp8": MAX_ROWS, "fp8-block": MAX_ROWS, "int4": TILE_ROWS}
_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _plan() -> dict[tuple[str, str | None], QuantSettings | None]:
    plan: dict[tuple[str, str | None], QuantSettings | None] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        key, sep, setting = item.partition("=")
        fmt, _, role = key.partition(":")
        if not sep or fmt not in FORMATS or (role and role not in ROLES):
            raise ValueError(f"{ENV}: {item!r} is not FORMAT=SETTING or FORMAT:ROLE=SETTING with FORMAT one of "
                             f"{', '.join(FORMATS)} and ROLE one of {', '.join(ROLES)}")
        if setting in ("off", "auto"):
            plan[fmt, role or None] = None if setting == "off" else QuantSettings(DEFAULTS[fmt])
            continue
        try:
            plan[fmt, role or None] = QuantSettings.parse(setting, fmt)
        except ValueError as e:
            raise ValueError(f"{ENV}: {key}: {setting!r} is not 'off', 'auto' or a label like n64k256s2st4w4 "
                             f"({e})") from None
    return plan


@functools.cache
def _gated_formats() -> tuple[str, ...]:
    value = os.environ.get(GATED_ENV)
    if value is None:
        return GATED_BY_DEFAULT
    formats = tuple(f for f in (part.strip() for part in value.split(",")) if f and f != "none")
    if any(f not in FORMATS for f in formats):
        raise ValueError(f"{GATED_ENV}={value!r}: expected formats among {', '.join(FORMATS)}, or 'none'")
    return formats


def settings_for(fmt: str, role: str | None) -> tuple[QuantSettings, int] | None:
    """(settings, the most rows of x they serve) for `fmt` layers named `role`: `RXF_QGEMV`'s entry, else
    `BY_DEFAULT`'s; None: off."""
    plan = _plan()
    for key in ((fmt, role), (fmt, None)):
        if key in plan:
            settings = plan[key]
            return None if settings is None else (settings, _MOST_ROWS[fmt])
    return BY_DEFAULT.get(fmt)


class QuantGemv:
    """One quantized layer's decode GEMV: its weight tensors as the kernel reads them, the resolved
    settings, and the split-K counters (allocated with the layer at load, so never inside a CUDA-graph
    capture; every launch leaves them zeroed). `scale_k`: the inputs one scale covers (the FP8 block,
    the int4 group; K for per-row scales); `scale_rows`: the output rows one block scale covers."""

    def __init__(
        self, fmt: str, settings: QuantSettings, weight: torch.Tensor, scales: torch.Tensor,
        zeros: torch.Tensor | None = None, *, scale_k: int, scale_rows: int = 1, max_rows: int = MAX_ROWS,
    ) -> None:
        from rxf.plugins.quantization import qgemv_kernel

        self.fmt = fmt
        self.kind = {"fp8": qgemv_kernel.FP8_ROWS, "fp8-block": qgemv_kernel.FP8_BLOCKS, "int4": qgemv_kernel.INT4}[fmt]
        int4 = self.kind == qgemv_kernel.INT4
        self.n, self.k = (weight.shape[1], weight.shape[0] * 8) if int4 else weight.shape
        self.weight, self.scales, self.zeros = weight, scales, zeros
        self.scale_k, self.scale_rows = scale_k, scale_rows
        self.fp8_x = settings.fp8_x
        self.settings = self._fit(settings.tiles, weight.device)  # ValueError: no tile fits K
        # A row setting serves one row of x; 2-8 rows take the tile kernel at the format's defaults (the
        # row label's own tile parameters, one stage, ran 4x slower at 2 rows: H100, 2026-12-05).
        self.tile = self._fit(DEFAULTS[fmt], weight.device) if self.settings.row else self.settings
        self.max_rows = max_rows
        blocks = max(-(-self.n // s.block_n) for s in (self.settings, self.tile))
        self.counters = torch.zeros(blocks, dtype=torch.int32, device=weight.device)
        self.tma_desc = self._tma_descriptor(weight) if settings.tma else None

    @property
    def label(self) -> str:
        """The resolved settings as `RXF_QGEMV` takes them."""
        return ("x" if self.fp8_x else "") + ("t" if self.tma_desc is not None else "") + self.settings.label

    def _tma_descriptor(self, weight: torch.Tensor):
        """The weight's TMA descriptor for the row setting's tiles (`qgemv_tma_kernel`), or None where
        the device has no TMA (before sm_90) or the weight's layout does not suit it: the register-fed
        row kernel then serves batch 1 at the same tiles."""
        from rxf.plugins.quantization.qgemv_tma_kernel import weight_descriptor

        if weight.is_cuda and torch.cuda.get_device_capability(weight.device) < (9, 0):
            logger.info("%s: TMA needs sm_90 or later; the row kernel reads the tiles", self.fmt)
            return None
        try:
            return weight_descriptor(weight, self.settings.block_n, self.settings.block_k)
        except ValueError as e:
            logger.info("%s: %s; the row kernel reads the tiles", self.fmt, e)
            return None

    def _fit(self, settings: GemvSettings, device: torch.device) -> GemvSettings:
        """`settings` with block_k inside the format's scale block and the split resolved for the shape."""
        fitted = dataclasses.replace(settings, block_k=min(settings.block_k, self.scale_k & -self.scale_k))
        return fitted.resolve(self.n, self.k, device)

    def takes(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype in _HALF and 0 < x.numel() // self.k <= self.max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, *, gated: bool = False) -> torch.Tensor:
        from rxf.plugins.quantization.qgemv_kernel import qgemv

        x2 = x.reshape(-1, self.k)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        s = self.settings if x2.shape[0] == 1 else self.tile
        if self.tma_desc is not None and s is self.settings and not gated:
            from rxf.plugins.quantization.qgemv_tma_kernel import qgemv_tma

            out = qgemv_tma(x2, self.kind, self.tma_desc, self.n, self.scales, bias, self.counters,
                            scale_rows=self.scale_rows, scale_k=self.scale_k, block_n=s.block_n, block_k=s.block_k,
                            split_k=s.split_k, num_stages=s.num_stages, num_warps=s.num_warps)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        out = qgemv(x2, self.kind, self.weight, self.scales, self.zeros, bias, self.counters,
                    scale_rows=self.scale_rows, scale_k=self.scale_k, block_n=s.block_n, block_k=s.block_k,
                    split_k=s.split_k, num_stages=s.num_stages, num_warps=s.num_warps, row=s.row, fp8_x=self.fp8_x,
                    gated=gated)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def activated(self, x: torch.Tensor, bias: torch.Tensor | None, act: nn.Module) -> torch.Tensor | None:
        """`act(self(x, bias))` in one launch of the row kernel, for a `[gate | up]` layer and `act` its
        SiLU·mul; None where the row kernel does not serve x (more rows than one, a tile setting) or
        the format does not take it (`GATED_ENV`): the caller then runs `act` as its own launch. A
        TMA setting's gated launch runs the register-fed row kernel at the same tiles."""
        from rxf.plugins.models.layers.activation import SiluAndMul

        if (self.fmt not in _gated_formats() or not self.settings.row or x.numel() != self.k
                or type(act) is not SiluAndMul or self.n % 2):
            return None
        return self(x, bias, gated=True)


def _sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _shape_default(fmt: str, weight: torch.Tensor) -> QuantSettings | None:
    """`SHAPE_DEFAULTS`' settings for this weight's (N, K) on an sm_90 device, else None."""
    if not _sm90(weight.device):
        return None
    n, k = (weight.shape[1], weight.shape[0] * 8) if fmt == "int4" else tuple(weight.shape)
    label = SHAPE_DEFAULTS.get((fmt, n, k))
    return None if label is None else QuantSettings.parse(label, fmt)


def _build(layer: nn.Module, fmt: str, *tensors: torch.Tensor | None, **kw: int) -> QuantGemv | None:
    role = getattr(layer, "gemv_role", None)
    chosen = settings_for(fmt, role)
    if chosen is None:
        return None
    _gated_formats()  # a bad RXF_QGEMV_GATED fails the load, not the first decode step
    settings = chosen[0]
    if chosen is BY_DEFAULT.get(fmt):  # no RXF_QGEMV entry: a measured setting for this shape, if any
        settings = _shape_default(fmt, tensors[0]) or settings
    try:
        return QuantGemv(fmt, settings, *tensors, max_rows=chosen[1], **kw)
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


def int4(layer: nn.Module, group_size: int) -> QuantGemv | int4_peers.TorchInt4Gemv | None:
    """The GEMV of an int4 layer in rxf's CUDA layout (`int4.py`), or None (off, or zeros that are
    not integers in [0, 128), which the kernel's exact half-precision `code - zero` needs); with a
    `PEERS` setting, that library's kernel instead (`int4_peers.build`)."""
    zeros = layer.zeros.data
    chosen = settings_for("int4", getattr(layer, "gemv_role", None))
    if chosen is not None and chosen[0].peer:
        return int4_peers.build(chosen[0].peer, layer, group_size)
    if not (torch.equal(zeros, zeros.round()) and bool(((zeros >= 0) & (zeros < 128)).all())):
        logger.info("int4: zero points that are not integers in [0, 128): no decode GEMV")
        return None
    return _build(layer, "int4", layer.qweight, layer.scales, zeros, scale_k=group_size)
