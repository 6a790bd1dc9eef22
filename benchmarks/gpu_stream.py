"""How fast can a batch-1 decode projection's weight bytes be read at all? The ceiling under the quantized
GEMV (issue 19): per Llama-3-8B projection in FP8 (one byte a weight), kernels that only read the weight
and fold it into one word per program (no dequantization, no x), beside the block-wise FP8 GEMV at its
shape default and bf16 cuBLAS on the same shape (twice the bytes).

Readers (`--readers`, all by default):
  rows      the row GEMV's access pattern (`qgemv_row_kernel`): program (b, s) reads rows [b * BN,
            (b + 1) * BN) over its K range in [BN, BK] tiles as int32 words, the next tile's loads
            issued before the current one is folded; labels `BNxBK` (bytes) with the split for about
            `PER_SM` programs a SM
  flat      each program reads one contiguous range of the weight in 16 KB tiles (the most
            favourable pattern for the memory: whole DRAM pages, no row stride)
  tma       the rows pattern read by the tensor memory accelerator (a host tensor descriptor; Triton's
            software pipeline keeps `stages` tiles in flight per program through shared memory)
  tail      the GEMV's default tile and split read as `rows` does, alone and with the GEMV's split-K
            hand-off (`finish_row`: partials, the counter, the last program's reduction and store)
  gemv      rxf's block-wise FP8 GEMV at the shape's default label (`qgemv.SHAPE_DEFAULTS`) and at
            `--labels` (default: no split, fewer rows a program)
  int4      the shape in int4 (AWQ / GPTQ words, groups of 128): `flat` over its bytes, and the int4
            GEMV at its default and at `--int4-labels`
  bf16      cuBLAS on the bf16 weight of the same shape (twice the bytes)

Times are `gpu_gemv.graph_us` (one call per rotating weight copy, >= 512 MB, in one CUDA graph); TB/s are
the bytes read over that time, and "of copy" their share of the device's copy rate
(`gpu_decode.copy_rate`, read + write over time), which the decode rooflines divide by. `--pick JSON`
prints the `RXF_QGEMV` of each role's fastest block-wise FP8 label in a `--json` file (`gpu_session.sh
stream` decodes with it).

    python3 benchmarks/gpu_stream.py [--readers rows,flat,tma,tail,gemv,int4,bf16] [--json OUT] [--pick JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import gpu_decode  # noqa: E402
import gpu_gemv  # noqa: E402

from rxf.plugins.models.layers.gemv_kernel import ROWS as BLOCK_M  # noqa: E402
from rxf.plugins.models.layers.gemv_row_kernel import finish_row  # noqa: E402
from rxf.plugins.quantization.qgemv import SHAPE_DEFAULTS  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
# (rows, bytes along K) of a rows tile; the row GEMV's tiles are 32-64 x 128-256 bytes
ROW_TILES = ((64, 128), (32, 256), (16, 512), (8, 1024), (64, 256), (32, 512))
PER_SM = (5, 10)  # programs a SM the split aims at (the row GEMV's default: 5)
TMA = ((64, 128, 3), (32, 256, 3), (16, 512, 3), (64, 256, 3), (64, 256, 4), (128, 256, 3))
# block-wise FP8 GEMV labels beside each shape's default: two tiles read ahead (`st2`) at tiles whose
# registers leave room for 8 or more programs a SM, split so that the grid is one wave of them
LABELS = "rn32k128s4st2w4,rn32k128s5st2w4,rn32k128s8st2w4,rn16k128s5st2w2,rn16k128s8st2w2,rn64k128s8st2w8,rn32k128s1st2w4"
# int4 (words [K / 8, N], N contiguous: a split over K is what gives narrow shapes their programs)
INT4_LABELS = "rn64k128s0st1w2,rn256k128s0st1w4,rn128k256s0st1w4"
INT4_DEFAULTS = {(4096, 4096): "rn128k128s18st1w4", (28672, 4096): "rn64k128s4st1w4"}
FLAT_TILE = 4096  # int32 words (16 KB) a flat tile
DEVICE = torch.device("cuda")


@triton.jit
def _rows_kernel(W, Out, Partials, Counters, K_WORDS, BN: tl.constexpr, BKW: tl.constexpr, SPLIT: tl.constexpr,
                 FINISH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    span = tl.cdiv(tl.cdiv(K_WORDS, BKW), SPLIT) * BKW
    k_lo = pid_k * span
    k_hi = tl.minimum(k_lo + span, K_WORDS)
    ptrs = W + rows.to(tl.int64)[:, None] * K_WORDS + (k_lo + tl.arange(0, BKW))[None, :]
    ok = (tl.zeros((BN,), tl.int32) + k_lo) < k_hi
    w = tl.load(ptrs, mask=ok[:, None], other=0)
    acc = tl.zeros((BN, BKW), tl.int32)
    for k0 in range(k_lo, k_hi, BKW):
        ptrs += BKW
        ok = (tl.zeros((BN,), tl.int32) + k0 + BKW) < k_hi
        w_next = tl.load(ptrs, mask=ok[:, None], other=0)  # issued before the current tile is folded
        acc ^= w
        w = w_next
    if FINISH:  # the GEMV's split-K hand-off and epilogue (`finish_row`) on the folded words
        finish_row(acc.to(tl.float32), acc.to(tl.float32), Out, Out, Partials, Counters, Out, rows, rows < 1 << 30,
                   tl.num_programs(0) * BN, 0, pid_n, pid_k, BN, SPLIT, False, False, False)
    else:
        tl.store(Out + pid_n * SPLIT + pid_k, tl.sum(acc, axis=None))


@triton.jit
def _flat_kernel(W, Out, WORDS, SPAN, TILE: tl.constexpr):
    pid = tl.program_id(0)
    lo = pid * SPAN
    hi = tl.minimum(lo + SPAN, WORDS)
    offs = lo + tl.arange(0, TILE)
    w = tl.load(W + offs, mask=offs < hi, other=0)
    acc = tl.zeros((TILE,), tl.int32)
    for _k0 in range(lo, hi, TILE):
        offs += TILE
        w_next = tl.load(W + offs, mask=offs < hi, other=0)
        acc ^= w
        w = w_next
    tl.store(Out + pid, tl.sum(acc, axis=0))


@triton.jit
def _tma_kernel(desc, Out, K_WORDS, BN: tl.constexpr, BKW: tl.constexpr, SPLIT: tl.constexpr,
                STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    span = tl.cdiv(tl.cdiv(K_WORDS, BKW), SPLIT) * BKW
    k_lo = pid_k * span
    k_hi = tl.minimum(k_lo + span, K_WORDS)
    acc = tl.zeros((BN, BKW), tl.int32)
    for k0 in tl.range(k_lo, k_hi, BKW, num_stages=STAGES):
        acc ^= desc.load([pid_n * BN, k0])
    tl.store(Out + pid_n * SPLIT + pid_k, tl.sum(acc, axis=None))


def _split(n: int, k_words: int, bn: int, bkw: int, per_sm: int) -> int:
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    return max(1, min(-(-per_sm * sms // (n // bn)), k_words // bkw))


def _rows(n: int, k: int, bn: int, bk: int, per_sm: int, finish: bool = False,
          split: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    bkw, kw = bk // 4, k // 4
    split = split or _split(n, kw, bn, bkw, per_sm)
    if finish:  # as the GEMV: bf16 out [1, n], float32 partials, zeroed counters
        out = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
        partials = torch.empty(n // bn * split * bn * BLOCK_M, dtype=torch.float32, device=DEVICE)
        counters = torch.zeros(n // bn, dtype=torch.int32, device=DEVICE)
    else:
        out = partials = counters = torch.empty(n // bn * split, dtype=torch.int32, device=DEVICE)
    return lambda w: _rows_kernel[(n // bn, split)](w, out, partials, counters, kw, BN=bn, BKW=bkw, SPLIT=split,
                                                    FINISH=finish, num_warps=4)


def _flat(n: int, k: int, per_sm: int) -> Callable[[torch.Tensor], torch.Tensor]:
    words = n * k // 4
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    span = -(-words // (per_sm * sms * FLAT_TILE)) * FLAT_TILE
    programs = -(-words // span)
    out = torch.empty(programs, dtype=torch.int32, device=DEVICE)
    return lambda w: _flat_kernel[(programs,)](w, out, words, span, TILE=FLAT_TILE, num_warps=4)


def _tma(n: int, k: int, bn: int, bk: int, stages: int, per_sm: int) -> Callable[[torch.Tensor], torch.Tensor]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bkw, kw = bk // 4, k // 4
    split = _split(n, kw, bn, bkw, per_sm)
    out = torch.empty(n // bn * split, dtype=torch.int32, device=DEVICE)
    descs: dict[int, Any] = {}

    def call(w: torch.Tensor) -> torch.Tensor:
        desc = descs.get(w.data_ptr())
        if desc is None:
            desc = descs[w.data_ptr()] = TensorDescriptor.from_tensor(w, [bn, bkw])
        return _tma_kernel[(n // bn, split)](desc, out, kw, BN=bn, BKW=bkw, SPLIT=split, STAGES=stages, num_warps=4)

    return call


def _gemv(n: int, k: int, x: torch.Tensor, scales: torch.Tensor, label: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from rxf.plugins.quantization.qgemv import QuantGemv, QuantSettings

    ops: dict[int, QuantGemv] = {}
    settings = QuantSettings.parse(label, "fp8-block")

    def call(w: torch.Tensor) -> torch.Tensor:
        op = ops.get(w.data_ptr())
        if op is None:
            op = ops[w.data_ptr()] = QuantGemv("fp8-block", settings, w.view(torch.float8_e4m3fn), scales, None,
                                               scale_k=128, scale_rows=128)
        return op(x, None)

    return call


def _int4(n: int, k: int, x: torch.Tensor, label: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The int4 GEMV (AWQ / GPTQ, groups of 128) at `label` over int32 words `[k / 8, n]`."""
    from rxf.plugins.quantization.qgemv import QuantGemv, QuantSettings

    scales = (torch.rand(k // 128, n, device=DEVICE) * 2e-3).to(torch.bfloat16)
    zeros = torch.full((k // 128, n), 8.0, dtype=torch.bfloat16, device=DEVICE)
    settings = QuantSettings.parse(label, "int4")
    ops: dict[int, QuantGemv] = {}

    def call(w: torch.Tensor) -> torch.Tensor:
        op = ops.get(w.data_ptr())
        if op is None:
            op = ops[w.data_ptr()] = QuantGemv("int4", settings, w, scales, zeros, scale_k=128)
        return op(x, None)

    return call


def _tile_of(label: str) -> tuple[int, int, int]:
    """(rows, bytes along K, split) of a row label `[t]rn{n}k{k}s{split}st..w..`."""
    m = re.fullmatch(r"t?rn(\d+)k(\d+)s(\d+)st\d+w\d+", label)
    assert m, label
    return int(m[1]), int(m[2]), int(m[3])


def _time(make: Callable[[], Callable[[torch.Tensor], torch.Tensor]], ws: list[torch.Tensor]) -> float | str:
    """GPU time per call of the reader `make()` builds, or why there is none."""
    try:
        return round(gpu_gemv.graph_us(make(), ws), 2)
    except Exception as e:  # a label the GEMV refuses, a tile Triton cannot compile here (shared memory, TMA)
        return f"failed: {type(e).__name__}: {e}"[:160]


def pick(results: dict[str, Any]) -> str:
    """`RXF_QGEMV` naming each role's fastest block-wise FP8 GEMV label in a `--json` file."""
    prefix = "fp8-block gemv "
    chosen = []
    for role, table in results["shapes"].items():
        timed = {name[len(prefix):]: r["us"] for name, r in table.items()
                 if name.startswith(prefix) and isinstance(r["us"], float)}
        if timed:
            chosen.append(f"fp8-block:{role}={min(timed, key=timed.get)}")
    return ",".join(chosen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readers", default="rows,flat,tma,tail,gemv,bf16")
    ap.add_argument("--labels", default=LABELS, help="block-wise FP8 GEMV labels timed beside the default")
    ap.add_argument("--int4-labels", default=INT4_LABELS, help="int4 GEMV labels timed beside the default")
    ap.add_argument("--json")
    ap.add_argument("--pick", metavar="JSON", help="print the RXF_QGEMV of each role's fastest GEMV label in JSON")
    args = ap.parse_args()
    if args.pick:
        print(pick(json.load(open(args.pick))))
        return
    readers = set(args.readers.split(","))
    copy = gpu_decode.copy_rate() / 1e12
    print(f"{torch.cuda.get_device_name()}: copy {copy:.2f} TB/s (read + write)")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_tbps": round(copy, 3), "shapes": {}}
    for role, (n, k) in SHAPES.items():
        copies = max(2, (1 << 29) // (n * k) + 1)
        ws = [torch.randint(-2**31, 2**31 - 1, (n, k // 4), dtype=torch.int32, device=DEVICE) for _ in range(copies)]
        nbytes = n * k
        rows: dict[str, Any] = {}
        if "rows" in readers:
            for bn, bk in ROW_TILES:
                for per_sm in PER_SM:
                    rows[f"rows {bn}x{bk}B {per_sm}/SM"] = _time(partial(_rows, n, k, bn, bk, per_sm), ws)
        if "flat" in readers:
            for per_sm in PER_SM:
                rows[f"flat 16KB {per_sm}/SM"] = _time(partial(_flat, n, k, per_sm), ws)
        if "tma" in readers:
            for bn, bk, stages in TMA:
                for per_sm in PER_SM:
                    rows[f"tma {bn}x{bk}B st{stages} {per_sm}/SM"] = _time(partial(_tma, n, k, bn, bk, stages, per_sm), ws)
        default = SHAPE_DEFAULTS[("fp8-block", n, k)]
        if "tail" in readers:  # the default tile and split read alone, then with the GEMV's hand-off
            bn, bk, split = _tile_of(default)
            rows[f"rows {bn}x{bk}B s{split}"] = _time(partial(_rows, n, k, bn, bk, 0, split=split), ws)
            rows[f"rows {bn}x{bk}B s{split} + hand-off"] = _time(partial(_rows, n, k, bn, bk, 0, True, split), ws)
        if "gemv" in readers:
            x = torch.randn(1, k, dtype=torch.bfloat16, device=DEVICE)
            scales = torch.rand(n // 128, k // 128, device=DEVICE) + 0.5
            for label in (default, *args.labels.split(",")):
                rows[f"fp8-block gemv {label}"] = _time(partial(_gemv, n, k, x, scales, label), ws)
        if "int4" in readers:  # the same shape in int4: half the bytes (plus scales and zeros)
            wi = [w.view(-1)[: n * k // 8].view(k // 8, n) for w in ws]
            x = torch.randn(1, k, dtype=torch.bfloat16, device=DEVICE)
            int4_bytes = n * k // 2 + 2 * 2 * (k // 128) * n
            for per_sm in PER_SM:
                us = _time(partial(_flat, n // 2, k, per_sm), wi)
                rows[f"int4 bytes: flat 16KB {per_sm}/SM"] = (us, int4_bytes)
            default = INT4_DEFAULTS.get((n, k), "rn128k128s0st1w2")
            for label in (default, *args.int4_labels.split(",")):
                rows[f"int4 gemv {label}"] = (_time(partial(_int4, n, k, x, label), wi), int4_bytes)
        rows = {name: v if isinstance(v, tuple) else (v, nbytes) for name, v in rows.items()}
        table = {name: {"us": us, "tbps": round(size / us / 1e6, 3), "of_copy": round(size / us / 1e6 / copy, 3)}
                 if isinstance(us, float) else {"us": us} for name, (us, size) in rows.items()}
        if "bf16" in readers:
            del ws
            wb = [torch.randn(n, k, dtype=torch.bfloat16, device=DEVICE) for _ in range(max(2, copies // 2))]
            x = torch.randn(1, k, dtype=torch.bfloat16, device=DEVICE)
            us = _time(partial(partial, torch.nn.functional.linear, x), wb)
            if isinstance(us, float):
                table["bf16 cuBLAS (2 bytes a weight)"] = {"us": us, "tbps": round(2 * nbytes / us / 1e6, 3),
                                                         "of_copy": round(2 * nbytes / us / 1e6 / copy, 3)}
            del wb
        results["shapes"][role] = table
        if args.json:  # after every shape: a later failure keeps what ran
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print(f"\n{role} {n} x {k}: {nbytes / 1e6:.1f} MB in FP8")
        for name, r in table.items():
            extra = f"{r['tbps']:.2f} TB/s, {100 * r['of_copy']:.1f}% of copy" if "tbps" in r else ""
            print(f"  {name:36s} {r['us']!s:>10} us  {extra}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
