"""Compile, on the CPU box, the DeepGEMM kernels that FlashInfer's SM90 FP8 block-scale GEMM
(`flashinfer.gemm.fp8_blockscale_gemm_sm90`, TensorRT-LLM's port) would compile on the GPU at first
use, so that a GPU call finds them in its cache instead of running nvcc mid-run.

That GEMM picks a kernel configuration from (M, N, K) and the card's SM count (132 on the H100 SXM
and the H200), renders a small instantiation of DeepGEMM's kernel template, compiles it with nvcc
into a cubin, and keeps it under `$TRTLLM_DG_CACHE_DIR/cache/<name>/nvcc_kernel.cubin`, where it looks
first. This script asks the library's own code for both (a host program over its headers, built here
with nvcc 13.0: `get_best_gemm_config`, `generateKernel`), for every M from 1 to --max-rows, and
compiles each distinct kernel once with the flags the library passes (Llama-3-8B's four projections:
39 kernels, ~1.4 s each). Needs `fi_cache_build.py prepare` and a build of the module
(`fi_cache_build.py build --only fp8_blockscale`: the host program links its logging objects).

    python3 benchmarks/deepgemm_cubins.py [--shapes 6144:4096,4096:4096,28672:4096,4096:14336]
        [--max-rows 16384] [--out .dg-cache]

gpu_session.sh sets TRTLLM_DG_CACHE_DIR to the carried .dg-cache/ when it exists.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

SITE_CSRC = Path("/tmp/fi-site/flashinfer/data/csrc")  # fi_cache_build.py prepare's FlashInfer
MODULE = Path("/tmp/fi-work/.fi-cache/.cache/flashinfer/0.6.6/90a/cached_ops/fp8_blockscale_gemm_90")
CUDA = Path("/tmp/fi-cuda")
NVCC = Path("/usr/local/cuda-13.0/bin/nvcc")
SMS = 132
LLAMA3_8B = "6144:4096,4096:4096,28672:4096,4096:14336"

# For each "N K M" line on stdin: the cache entry's name and the kernel source, as the library's
# gemm_dispatch builds them (swapped operands below 32 rows), separated by marker lines.
HOST_PROGRAM = r"""
#include <iostream>
#include "deep_gemm/compiler.cuh"
int main() {
  uint32_t n, k, m;
  while (std::cin >> n >> k >> m) {
    bool swap = m < 32;
    auto [bm, bn, stages, mc, smem] = swap
        ? deep_gemm::jit::get_best_gemm_config(n, m, k, 1, SMS, false, true)
        : deep_gemm::jit::get_best_gemm_config(m, n, k, 1, SMS);
    std::string st = std::to_string(stages);
    std::cout << "@@@ " << (swap ? "gemm_swapAB_" : "gemm_") << n << "_" << k << "_" << bm << "_" << bn
              << "_128_1_" << st << "1_" << st << "_" << mc << "_Normal\n"
              << deep_gemm::jit::generateKernel(n, k, bm, bn, 128, 1, stages, mc, deep_gemm::GemmType::Normal, swap)
              << "\n@@@END\n";
  }
}
"""

# compiler.cuh's nvcc flags (its `build`, nvcc branch), then the include dir FlashInfer sets
FLAGS = ["-std=c++17", "--gpu-architecture=sm_90a", "--ptxas-options=-allow-expensive-optimizations=true",
         "--ptxas-options=--register-usage-level=10", "--diag-suppress=161,174,177,940",
         "-D__FORCE_INCLUDE_CUDA_FP16_HPP_FROM_FP16_H__=1", "-D__FORCE_INCLUDE_CUDA_BF16_HPP_FROM_BF16_H__=1",
         "-O3", "-cubin", "--expt-relaxed-constexpr", "--expt-extended-lambda",
         "--compiler-options=-fPIC,-O3,-Wno-deprecated-declarations,-Wno-abi"]


def kernels(shapes: list[tuple[int, int]], max_rows: int, work: Path) -> dict[str, str]:
    """name -> source of every kernel the GEMM picks for M in 1..max_rows over `shapes`."""
    src = work / "gen.cu"
    src.write_text(HOST_PROGRAM.replace("SMS", str(SMS)))
    objs = [str(MODULE / f"{o}.o") for o in ("logger", "stringUtils", "tllmException", "envUtils")]
    subprocess.run([str(NVCC), "-std=c++17", "-arch=sm_90a", f"-I{SITE_CSRC}/nv_internal/tensorrt_llm",
                    f"-I{SITE_CSRC}/nv_internal", f"-I{SITE_CSRC}/nv_internal/include", f"-I{CUDA}/include",
                    "-DENABLE_BF16", "-DENABLE_FP8", str(src), *objs, f"-L{CUDA}/lib64", f"-L{CUDA}/lib64/stubs",
                    "-lcudart", "-lcuda", "-o", str(work / "gen")], check=True, capture_output=True)
    lines = "".join(f"{n} {k} {m}\n" for n, k in shapes for m in range(1, max_rows + 1))
    out = subprocess.run([str(work / "gen")], input=lines, capture_output=True, text=True, check=True,
                         env={**os.environ, "LD_LIBRARY_PATH": f"{CUDA}/lib64"}).stdout
    found: dict[str, str] = {}
    for block in out.split("@@@END\n"):
        if block.startswith("@@@ "):
            head, _, code = block.partition("\n")
            found.setdefault(head[4:], code)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=LLAMA3_8B, help="N:K of each weight, comma-separated")
    ap.add_argument("--max-rows", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=Path(".dg-cache"))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        found = kernels(shapes, args.max_rows, Path(tmp))
        print(f"{len(found)} kernels for M in 1..{args.max_rows} over {len(shapes)} shapes")
        for name, code in sorted(found.items()):
            cubin = args.out / "cache" / name / "nvcc_kernel.cubin"
            if cubin.exists():
                continue
            cubin.parent.mkdir(parents=True, exist_ok=True)
            kernel = Path(tmp) / "kernel.cu"
            kernel.write_text(code)
            start = time.time()
            subprocess.run([str(NVCC), str(kernel), "-o", str(cubin), *FLAGS,
                            f"-I{SITE_CSRC}/nv_internal/tensorrt_llm"], check=True)
            print(f"{name}: {cubin.stat().st_size} bytes in {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
