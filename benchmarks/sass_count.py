"""Instructions per weight in the K loop of the batch-1 GEMV kernels, compiled for the H200 (sm_90) on a
machine without a GPU: a static measure of a kernel's ALU cost while no device time is left.

    python benchmarks/sass_count.py [--kernel fp8|fp8-block|int4|bf16|fp8-x|fp8-block-x|fp8-tma|fp8-block-tma|
        moe-gate-up|moe-down]
        [--block-n 16 --block-k 256 --warps 8] [--experts fp8-block|fp8-row|bf16] [--gated] [--regs]

`--regs` adds the registers a thread takes (ptxas's report for the kernel's PTX) and how many programs an
SM then holds: a latency-bound GEMV keeps only that many tiles in flight per SM (benchmarks/RESULTS.md,
2026-12-07: the block-wise FP8 row kernel at 64 x 128 / 4 warps, 121 registers, 4 programs).

fp8-tma / fp8-block-tma: the row kernel fed by TMA (`qgemv_tma_kernel`, `--stages` its pipeline's
stages, at least 2); `--regs` then adds its shared memory and the programs a SM that leaves.
fp8-x / fp8-block-x: the tile kernel (`qgemv_kernel`, 4 stages) with x quantized to E4M3 per tile and
FP8 x FP8 dots (`RXF_QGEMV` label prefix x); its multiplies run on the tensor cores (QGMMA), so its
count is the per-weight share of everything else (x's quantization, addresses, the pipeline).
moe-gate-up / moe-down: the MoE decode kernels' ROW form (`fused_moe_decode.py`, top 8) over experts
in `--experts` (FP8 with 128-input block scales or row scales, or bf16); gate/up counts both rows.

Triton compiles the kernel for `GPUTarget("cuda", 90, 32)` (its bundled ptxas), with every pointer and
integer argument marked divisible by 16 as a launch specializes them (without that, loads are not
vectorized and the counts mean nothing); the SASS comes from Triton's bundled nvdisasm. The loop is
the longest backward branch's body; "per weight" divides its instructions by the weights one thread
handles per iteration (BLOCK_N * BLOCK_K / threads). Memory-bound kernels do not follow these counts;
ALU-bound ones (the int4 dequantization) do, roughly: the H200 issues ~29.6 T thread-instructions
a second (132 SMs x 4 schedulers x 32 lanes x 1.75 GHz). The compiler is this machine's Triton (3.9
on 2026-12-05), not the GPU machine's (3.6): its code may differ there.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

_QUANT_SIG = {"X": "*bf16", "W": "*fp8e4nv", "Scales": "*fp32", "Zeros": "*fp32", "Bias": "*bf16", "Out": "*bf16",
              "Partials": "*fp32", "Counters": "*i32", "N": "i32", "K": "i32", "stride_w": "i32", "stride_s": "i32",
              "stride_om": "i32"}
_DENSE_SIG = {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "Out": "*bf16", "Partials": "*fp32", "Counters": "*i32",
              "N_OUT": "i32", "K": "i32", "stride_wn": "i32", "stride_om": "i32"}


def compile_sm90(fn, signature: dict[str, str], constants: dict, warps: int, stages: int = 3):
    sig = {**signature, **dict.fromkeys(constants, "constexpr")}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] not in ("constexpr", "fp32")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def registers(kernel) -> int:
    """Registers a thread of `kernel` takes, as Triton's bundled ptxas reports them for its PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Used (\d+) registers", report).group(1))


_SMEM_PER_SM = 228 * 1024  # an H100 / H200 SM's shared memory (1 KB of it reserved per program: ignored)


def programs_per_sm(regs: int, warps: int) -> int:
    """How many programs of `warps` warps and `regs` registers a thread an H100 / H200 SM holds at
    once by registers (65,536, allocated 256 a warp) and warps (64); shared memory aside."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 64 // warps, 32)


def loop_instructions(kernel) -> list[str]:
    """The body of the longest backward branch that holds no EXIT: the K loop (an mbarrier wait's retry
    path, which ptxas places past the kernel's exits and which jumps back into the loop, spans more)."""
    labels: dict[str, int] = {}
    ins: list[str] = []
    for line in get_sass(kernel.asm["cubin"]).splitlines():
        if m := re.match(r"\s*(\.?L\w+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*[-0-9a-f]+:[-0-9a-f]:[-0-9a-f]:[-Y]:[0-9a-f]+\s+(.*)", line):
            ins.append(m.group(1))
    loop: list[str] = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+`?\(?(\.?L\w+)", text)
        if m and labels.get(m.group(1), i) < i and i + 1 - labels[m.group(1)] > len(loop):
            body = ins[labels[m.group(1)]:i + 1]
            if not any(re.search(r"\bEXIT\b", t) for t in body):
                loop = body
    return loop


def _moe(kernel: str, experts: str, bn: int, bk: int) -> tuple:
    from rxf.plugins.models.layers.fused_moe_decode import _down_kernel, _gate_up_kernel

    w = "*bf16" if experts == "bf16" else "*fp8e4nv"
    if experts == "fp8-block":
        bk = min(bk, 128)  # as the launch does (`moe.kernel_scale_args`): a K tile inside one scale block
    scales = dict(ROW_SCALED=experts == "fp8-row", BLOCK_SCALED=experts == "fp8-block",
                  SCALE_BK=128 if experts == "fp8-block" else 1, PDL=True, ROW=True)
    strides = dict.fromkeys(("stride_we", "stride_wn", "stride_be", "stride_se", "stride_sn"), "i32")
    if kernel == "moe-gate-up":
        sig = {"X": "*bf16", "W13": w, "B13": w, "S13": "*fp32", "Act": "*bf16", "TopkIds": "*i32", "N": "i32",
               "K": "i32", "stride_xt": "i32", **strides, "stride_ap": "i32"}
        consts = dict(TOP_K=8, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, HAS_BIAS=False, ALPHA=1.0, HAS_LIMIT=False,
                      LIMIT=0.0, UP_OFFSET=0.0, **scales)
        return _gate_up_kernel, sig, consts
    sig = {"Act": "*bf16", "W2": w, "B2": w, "S2": "*fp32", "Y": "*bf16", "TopkWeights": "*fp32", "TopkIds": "*i32",
           "Partials": "*fp32", "Counters": "*i32", "N": "i32", "K": "i32", "stride_ap": "i32", **strides,
           "stride_yt": "i32"}
    return _down_kernel, sig, dict(TOP_K=8, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, HAS_BIAS=False, **scales)


def main() -> None:
    from rxf.plugins.models.layers.gemv_row_kernel import _gemv_row_kernel
    from rxf.plugins.quantization.qgemv_row_kernel import _qgemv_row_kernel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["fp8", "fp8-block", "int4", "int4-f16", "int4-f32", "int4-tile", "bf16", "fp8-x", "fp8-block-x",
                                         "fp8-tma", "fp8-block-tma", "moe-gate-up", "moe-down"], default="fp8")
    ap.add_argument("--experts", choices=["fp8-block", "fp8-row", "bf16"], default="fp8-block")
    ap.add_argument("--block-n", type=int, default=16)
    ap.add_argument("--block-k", type=int, default=256)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=0, help="pipeline stages (default: 4 for tile kernels, else 3)")
    ap.add_argument("--gated", action="store_true", help="quantized row kernels: [gate | up] and SiLU·mul")
    ap.add_argument("--regs", action="store_true", help="also the registers a thread (ptxas) and the programs a SM")
    args = ap.parse_args()
    bn, bk = args.block_n, args.block_k
    rows = 1  # weight rows a program multiplies per output column (gate/up: two)
    if args.kernel.startswith("moe"):
        fn, sig, consts = _moe(args.kernel, args.experts, bn, bk)
        bk = consts["BLOCK_K"]
        rows = 2 if args.kernel == "moe-gate-up" else 1
    elif args.kernel.endswith("-x") or args.kernel == "int4-tile":
        from rxf.plugins.quantization.qgemv_kernel import _qgemv_kernel

        fmt = {"fp8-block-x": 1, "fp8-x": 0, "int4-tile": 2}[args.kernel]
        fn = _qgemv_kernel
        sig = {**_QUANT_SIG, "M": "i32", "stride_xm": "i32", "MASK": "i32", "MAGIC": "i32"}
        if fmt == 2:
            sig.update(W="*i32", Scales="*bf16", Zeros="*bf16")
        consts = dict(FORMAT=fmt, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=2, HAS_BIAS=False, EVEN_N=True, IEEE=False,
                      SCALE_ROWS=128 if fmt == 1 else 1, SCALE_K=4096 if fmt == 0 else 128, OFFSET=128.0,
                      PDL=True, XQ=fmt != 2)
        sig = {name: sig[name] for name in ("X", "W", "Scales", "Zeros", "Bias", "Out", "Partials", "Counters", "M",
                                            "N", "K", "stride_xm", "stride_w", "stride_s", "stride_om", "MASK", "MAGIC")}
    elif args.kernel.endswith("-tma"):  # `qgemv_tma_kernel` (label prefix t), --stages its pipeline's
        from rxf.plugins.quantization.qgemv_tma_kernel import _qgemv_tma_kernel

        fmt = int(args.kernel == "fp8-block-tma")
        fn = _qgemv_tma_kernel
        sig = {name: _QUANT_SIG[name] for name in ("X", "Scales", "Bias", "Out", "Partials", "Counters", "N", "K",
                                                   "stride_s", "stride_om")}
        sig = {"X": sig.pop("X"), "desc": f"tensordesc<i32[{bn}, {bk // 4}]>", **sig}
        consts = dict(FORMAT=fmt, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=2, HAS_BIAS=False, SCALE_ROWS=128 if fmt else 1,
                      SCALE_K=128 if fmt else 4096, PDL=True, ASM=True, STAGES=max(args.stages, 2))
    elif args.kernel == "bf16":
        fn, sig = _gemv_row_kernel, _DENSE_SIG
        consts = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=2, GATED=False, HAS_BIAS=False, PDL=True)
    else:
        fmt = {"fp8": 0, "fp8-block": 1, "int4": 2, "int4-f16": 2, "int4-f32": 2}[args.kernel]
        fn = _qgemv_row_kernel
        sig = {**_QUANT_SIG, "MASK": "i32", "MAGIC": "i32"}
        if fmt == 2:
            half = "*fp16" if args.kernel == "int4-f16" else "*bf16"
            sig.update(X=half, Bias=half, Out=half, W="*i32", Scales=half, Zeros=half)
        # int4: two codes an operation in bf16 (the default; int4-f16: fp16 x); int4-f32: one in float32
        # (RXF_INT4_PAIRS=0)
        consts = dict(FORMAT=fmt, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=2, HAS_BIAS=False, SCALE_ROWS=1,
                      SCALE_K=128 if fmt else 4096, PDL=True, ASM=True, PAIRS=args.kernel in ("int4", "int4-f16"),
                      OFFSET=64.0 if args.kernel == "int4-f16" else 128.0, BF16=args.kernel != "int4-f16",
                      AHEAD=2 if args.stages >= 2 else 1,  # --stages 2: two weight tiles read ahead
                      GATED=args.gated)
        if args.gated:  # block_n counts the rows read, gate and up (`qgemv_kernel.qgemv`)
            consts["BLOCK_N"], rows = bn // 2, 2
            bn //= 2
    tile = args.kernel.endswith("-x") or args.kernel == "int4-tile"
    kernel = compile_sm90(fn, sig, consts, args.warps, args.stages or (4 if tile else 3))
    loop = loop_instructions(kernel)
    ops = collections.Counter(re.sub(r"^@!?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
    per_thread = rows * bn * bk / (32 * args.warps)
    print(f"{args.kernel} {bn} x {bk}, {args.warps} warps: {len(loop)} loop instructions, "
          f"{len(loop) / per_thread:.2f} a weight")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(16)))
    if args.regs:
        regs = registers(kernel)
        smem = kernel.metadata.shared
        by_smem = f", {smem / 1024:.1f} KB of shared memory ({_SMEM_PER_SM // smem} a SM by it)" if smem >= 1024 else ""
        print(f"{regs} registers a thread: {programs_per_sm(regs, args.warps)} programs a SM{by_smem}")


if __name__ == "__main__":
    main()
