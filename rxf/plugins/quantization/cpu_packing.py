"""Packed-weight matmuls on the CPU: weight-only int4 and int8 through torch's packed-weight ops, and
dense bf16 through oneDNN's packed layout.

int4: `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)` computes
`x @ W.T` with `W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`, g = k // group, group one of
32 / 64 / 128 / 256, `packed` made from int32 codes `[N, K]` by `_convert_weight_to_int4pack_for_cpu`
(N a multiple of 16) and `scales_and_zeros` `[G, N, 2]`. A format that stores `(q - z) * s` maps
onto it exactly with `zero = (8 - z) * s`; one whose groups are a multiple of 32 but none of those
sizes repeats each group's scale over its runs of the largest size that divides it.

int8: `torch.ops.aten._weight_int8pack_mm(x, q, scales)` computes `x @ (q * scales[:, None]).T` for
int8 `q` `[N, K]` and one scale per output row; K must be a multiple of 16 (other widths crash
torch 2.13's kernel for batches of more than one row).

Both ops are fast for bf16 activations only (float32 runs a slow reference loop: 1.2 ms against
16 us for a 960 x 576 int4 matmul of one row, measured), so activations are cast to bf16 around
the call and `scales_and_zeros` / `scales` are held in bf16: a relative rounding of 2^-9 on every
activation and on every scale, the parity the tests state. The op accumulates in float32.

dense bf16: `torch.ops.mkldnn._reorder_linear_weight(W)` reorders a `[N, K]` weight once, at load,
into oneDNN's blocked layout (an opaque mkldnn tensor), and `torch.ops.mkldnn._linear_pointwise`
multiplies by it: the same product as `F.linear` (measured: equal bits at 1 row), 1.4-2.4x faster
for 1-16 rows and 3-5% for 256 on the 2-core AMD VM (AVX512-BF16), one thread, the demo's shapes
(576 x 3072 at 1 row: 108 -> 55 us; the 49152-row head: 3.5 -> 1.5 ms; benchmarks/RESULTS.md).
float32 would gain too (1.1-2.8x), but its sums then round differently from F.linear's (2.7e-5
at 576 inputs), and float32 is the exactness reference of the tests, so it stays on F.linear.

A few rows (up to 4: a decode step of a few requests) read the plain weight instead, through the C++
op `rxf_dense::linear` (`csrc/dense_bf16.cpp`, built on first use like the attention op): one
sequential pass over each weight row with AVX512-BF16 dot products runs at 15-19 GB/s on one core
against oneDNN's 9-11 (the demo's 121 matmuls at one row: `bench_cpu_step.py --matmuls`; a compiled
batch-1 step 37.9 -> 27.0 ms at one thread, 25.3 -> 19.7 at two, benchmarks/RESULTS.md). So on a CPU with AVX512-BF16 a packed layer keeps its plain weight too: the
dense weights' memory twice (the demo: 212 MB more). The op calls oneDNN on the packed copy for
larger batches, and being C++, it spares the compiled forward the Python dispatch of a custom op
(~12 us a matmul). The two paths round alike but for the order of their float32 sums.

Where oneDNN has no bf16 kernels (a CPU with AVX2 but no AVX-512 or AVX-NE-CONVERT: nothing packs),
a bf16 matmul runs torch's emulated path, linear in its rows at ~90 us a row for a 576 x 1536 weight:
8.5x slower than float32 from 64 rows on (4096 rows: 440 vs 52 ms, two threads, the 2-core AMD VM
without AVX-512), while at one row, where reading the weight is the cost, bf16 is 2-4x faster. So
such a layer computes batches of `UPCAST_MIN_ROWS` rows or more in float32 (`upcast_linear`: the
weight cast per call, no second copy kept) and fewer in bf16; the crossover measured 6-8 rows for
the demo's projections, ~40 for its 49152-row head, whose cast alone takes ~60 ms
(`HEAD_UPCAST_MIN_ROWS`). Both accumulate in float32 and round the output to bf16 (the head's
logits stay float32), so they differ only in the order of their sums.

On such a CPU torch's int4 op is no faster for large batches: 2.2-3x slower than a float32 matmul by
the dequantized weight at 1,024-4,096 rows, on a par at 32, 4-9x faster at 1-4 (the demo's
projections, two threads; `benchmarks/bench_cpu_bf16_matmul.py --int4`). So there an int4 layer
keeps its codes two to a byte beside the packed weight (`pack_nibbles`: the int4 weights' memory
twice) and multiplies batches of `INT4_DEQUANT_MIN_ROWS` rows or more by the float32 weight
dequantized per call (`dequantize_nibbles`: 0.3-0.7 ms for the demo's projections); fewer rows
take the op. Vision towers, whose every matmul has hundreds of patch rows, are built in float32
there outright (`large_matmul_dtype`).

`RXF_CPU_WEIGHT_PACKING=0` turns the packed and float32 paths off: every int4 / int8 method then dequantizes at
load and computes in the model's dtype with exactly the weights its format encodes (the parity
reference, and the path where the ops are missing or a layer's shape does not fit them), and dense
layers keep F.linear at every batch size.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "RXF_CPU_WEIGHT_PACKING"
INT4_GROUPS = (256, 128, 64, 32)  # the group sizes the int4 op takes, largest first
COMPUTE_DTYPE = torch.bfloat16


def enabled() -> bool:
    """Whether the packed ops serve CPU layers (read at each load, so a test can switch it)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def dense_packable(weight: torch.Tensor) -> bool:
    """Whether a dense weight's matmul runs on oneDNN's packed layout: a 2-D bf16 CPU weight, with
    packing on and oneDNN's bf16 kernels present."""
    return (
        os.environ.get(ENV, "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and onednn_bf16()
    )


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX512-BW or AVX-NE-CONVERT and up)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


UPCAST_MIN_ROWS = 16
HEAD_UPCAST_MIN_ROWS = 64
INT4_DEQUANT_MIN_ROWS = 64


def emulated_bf16(weight: torch.Tensor) -> bool:
    """Whether `weight` is a bf16 CPU weight that oneDNN cannot multiply in bf16 (`upcast_linear`
    serves its larger batches)."""
    return _emulates(weight.dtype, weight.device)


def _emulates(dtype: torch.dtype, device: torch.device) -> bool:
    return os.environ.get(ENV, "1") != "0" and device.type == "cpu" and dtype == torch.bfloat16 and not onednn_bf16()


def large_matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to build a module of large matmuls alone in (a vision tower: hundreds of patch rows
    a call) on the default device: float32 where that device is a CPU that would emulate bf16 (every
    such matmul is then 6-8x slower than float32, and casting its weights per call is a waste), else
    `dtype`. The weights' memory doubles there."""
    return torch.float32 if _emulates(dtype, torch.get_default_device()) else dtype


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ W.T + bias` computed in float32, in `out_dtype` (default x's)."""
    out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` in oneDNN's packed layout (an opaque tensor only `dense_linear` reads)."""
    _dense_op()  # loaded before any forward that reads the packed weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


_DENSE_SOURCE = Path(__file__).parent / "csrc" / "dense_bf16.cpp"
_build_lock = threading.Lock()
# `torch.ops.rxf_dense.linear` once `pack_dense` has loaded it (a plain global: the compiled forward
# reads it, and dynamo cannot trace the build's lock and file work).
_dense_linear_op = None


@functools.cache
def _dense_op():
    """`torch.ops.rxf_dense.linear`, built and loaded on the first call; None where it cannot be built
    (no compiler: the matmuls then stay on oneDNN's packed weight alone)."""
    from rxf.plugins.attention.cpp_build import load_ops

    global _dense_linear_op
    with _build_lock:
        try:
            load_ops(_DENSE_SOURCE)
        except (RuntimeError, OSError) as e:
            logger.warning("dense bf16 op unavailable, matmuls stay on oneDNN: %s", e)
            return None
        torch.library.register_fake("rxf_dense::linear")(_linear_fake)
    _dense_linear_op = torch.ops.rxf_dense.linear
    return _dense_linear_op


def keeps_plain_weight() -> bool:
    """Whether a packed layer keeps its plain weight too, for `dense_linear`'s few-row kernel (a
    CPU with AVX512-BF16 and the op built)."""
    return _dense_op() is not None and torch.ops.rxf_dense.dot_kernel_available()


def dense_linear(x: torch.Tensor, packed: torch.Tensor, plain: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` for `packed` = pack_dense(W) and `plain` = W or None (`keeps_plain_weight`);
    x `[..., K]` in W's dtype. Traced by torch.compile, it is one opaque op (`rxf_dense::linear`, or
    where that cannot be built `rxf::packed_dense_linear`): Inductor lowers the mkldnn op only for
    weights it packed itself (frozen graph constants)."""
    if _dense_linear_op is not None:
        return _dense_linear_op(x, packed, plain, bias)
    if torch.compiler.is_compiling():
        return packed_dense_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _linear_fake(x: torch.Tensor, packed: torch.Tensor, plain: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("rxf::packed_dense_linear", mutates_args=())
def packed_dense_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_dense_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def int4_kernel_group(n: int, k: int, group: int) -> int | None:
    """The op's group size for a layer of `n` outputs and `k` inputs in groups of `group`, or None
    where the op cannot serve it (packing off, N not a multiple of 16, groups not a multiple of 32)."""
    if not enabled() or n % 16 or k % group:
        return None
    return next((g for g in INT4_GROUPS if group % g == 0), None)


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, group: int, kernel_group: int) -> torch.Tensor:
    """torch's int4 ops' `[G, N, 2]` bf16 table (CPU and CUDA alike) for `(q - z) * s`: each group's
    scale and offset `(8 - z) * s`, repeated over its runs of `kernel_group` inputs."""
    repeat = group // kernel_group
    s = scales.float().repeat_interleave(repeat, 0)
    z = zeros.float().repeat_interleave(repeat, 0)
    return torch.stack([s, (8 - z) * s], dim=-1).to(COMPUTE_DTYPE).contiguous()


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[N, K]` (0..15) in the int4 op's packed layout (its tile count argument is
    ignored on the CPU)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def set_packed_int4(layer: torch.nn.Module, codes: torch.Tensor, scales_and_zeros: torch.Tensor,
                    kernel_group: int) -> None:
    """Give `layer` the packed int4 weight that `packed_int4_linear` computes with, from codes `[N, K]`
    (0..15) and the op's table `[G, N, 2]` for groups of `kernel_group` inputs. Where oneDNN has no
    bf16 kernels it keeps the codes too, two to a byte (`int4_nibbles`, as much memory again), for
    the larger batches that it dequantizes."""
    layer.add_param("qweight", pack_codes(codes))
    layer.add_param("scales_and_zeros", scales_and_zeros.to(COMPUTE_DTYPE).contiguous())
    layer.kernel_group = kernel_group
    layer.int4_nibbles = None
    if not onednn_bf16():
        layer.add_param("int4_nibbles", pack_nibbles(codes))


def packed_int4_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.int4_nibbles is not None and x.numel() >= INT4_DEQUANT_MIN_ROWS * x.shape[-1]:
        w = dequantize_nibbles(layer.int4_nibbles, layer.scales_and_zeros, layer.kernel_group)
        return upcast_linear(x, w, bias)
    return int4_linear(x, layer.qweight, layer.kernel_group, layer.scales_and_zeros, bias)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes `[N, K]` (0..15) two to a byte, `[N, K / 2]` uint8: input i in the low nibble of byte i,
    input K/2 + i in its high nibble (each half unpacks in one contiguous pass)."""
    half = codes.shape[1] // 2
    codes = codes.to(torch.uint8)
    return (codes[:, :half] | (codes[:, half:] << 4)).contiguous()


def dequantize_nibbles(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int) -> torch.Tensor:
    """The float32 weight `[N, K]` the int4 op multiplies by, `(q - 8) * scale + zero` per group of
    `kernel_group` inputs, from `pack_nibbles`' codes and the op's `[G, N, 2]` table."""
    n, half = nibbles.shape
    w = torch.empty(n, 2 * half, dtype=torch.float32)
    w[:, :half] = nibbles & 15
    w[:, half:] = nibbles >> 4
    table = scales_and_zeros.float().transpose(0, 1)  # [N, G, 2]
    scale = table[..., :1].contiguous()
    offset = (table[..., 1:] - 8 * scale).contiguous()
    return w.view(n, -1, kernel_group).mul_(scale).add_(offset).view(n, -1)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, kernel_group: int, scales_and_zeros: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE), packed, kernel_group, scales_and_zeros)
    return _finish(out, x, bias)


def int8_fits(k: int) -> bool:
    return enabled() and k % 16 == 0


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE), q, scales)
    return _finish(out, x, bias)


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias
