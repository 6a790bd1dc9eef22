"""Build FlashInfer 0.6.6's JIT kernel modules for an H200 (sm_90a) on a CPU-only machine, so that a
GPU call restores them (`gpu_session.sh` unpacks .fi-parts/fi-cache.txz.part-*) and skips the nvcc compiles.

FlashInfer runs ninja on every module it loads (`JitSpec.build_and_load`: no AOT package), so the
restored objects must be up to date in ninja's eyes on the GPU machine: the same build.ninja (its
command lines are hashed into .ninja_log), and every header recorded in .ninja_deps present there
and older than the object. So the build reproduces the GPU machine's paths exactly, as its own
build.ninja files show them: FlashInfer and tvm_ffi under /root/site (gpu_session.sh's
`pip install --target $HOME/site`, headers touched to 946684800), the repo at /work/main
(FLASHINFER_WORKSPACE_BASE=/work/main/.fi-cache), CUDA 13.0 at /usr/local/cuda, gcc 13 at
/opt/gcc/bin/{gcc,g++} (CC/CXX) with libstdc++ 13 in /usr/include/c++/13 and gcc's own headers in
/opt/gcc/lib/gcc/x86_64-linux-gnu/13/include, Python's include dir /usr/include/python3.12. Those
paths live in a chroot of Debian 13's gcc-13 (13.3.0, the GPU image's Ubuntu 24.04 has 13.3.0 too)
entered in a private mount namespace, so nothing on this machine outside /tmp changes.

Steps (as root, from the repo root; PyPI and Debian's archive are the only network use):

    python3 benchmarks/fi_cache_build.py prepare   # chroot, /tmp/fi-site, /tmp/fi-venv311
    python3 benchmarks/fi_cache_build.py build [--only SUBSTR ...] [--restore PART ...]
    python3 benchmarks/fi_cache_build.py pack --out /tmp/fi-parts-new

`prepare` downloads Debian trixie's g++-13 and libc6-dev with their dependencies (apt-get with
private lists under /tmp/fi-apt; the system's sources are untouched) and unpacks them into
/tmp/fi-chroot, copies gcc into /opt/gcc there; installs .whl/'s flashinfer and tvm_ffi wheels into
/tmp/fi-site as gpu_session.sh does (plus tvm_ffi's cp311 extension from PyPI, same version, so the
CPU torch wheel's Python 3.11 can import it: its headers are byte-identical to the cp312 wheel's);
makes /tmp/fi-venv311 (pyenv's Python 3.11, `pip install torch==2.13.0` CPU, ninja 1.13.0: the
GPU's .ninja_log is v7). It needs this machine's /usr/local/cuda-13.0 (nvcc 13.0.88).
`build` unpacks the given parts (the existing cache) into /tmp/fi-work/.fi-cache, then inside the
chroot calls FlashInfer's own generators (`flashinfer.jit.*gen_*_module(...)`) and each spec's
`build()`, most useful first (MODULES below); modules whose .so exists are skipped. `pack` writes
`tar czf - .fi-cache | split -b 15M` parts.

Status (2026-12-06): all 17 modules below built here in ~37 min (an fa3 prefill module ~3.5-4 min on
2 cores, an fa2 one ~1 min), and on an H100 ninja found every restored module up to date ("no work to
do", `gpu_session.sh fi-tests`); the 44 FlashInfer cases of tests/gpu/test_attention_features_gpu.py
then passed in 12 s (benchmarks/RESULTS.md). All 17 pack into 8.1 MB with xz (48.6 MB with gzip, which
with .whl/ and the tree passed the 64 MiB a call may carry: that run left two fa3 modules out).

MODULES: what tests/gpu/test_attention_features_gpu.py (flashinfer cases), gpu_decode.py's jit
phase (presets llama3-8b and tiny) and rxf's layers (norm, rope, silu / gelu_tanh and mul) load on
an H200, all bf16 with int32 indptr and no positional encoding: ragged and paged prefill wrappers
take fa3 on sm90 (`determine_attention_backend`), the tensor-core decode wrapper (query heads / KV
heads >= 4) the fa2 prefill module, the plain decode wrapper the batch_decode module, and the sink
wrapper the fa3 `batch_prefill_attention_sink` module (its URI has no head_dim: 64 here); and the
FP8 block-scale GEMM module (TensorRT-LLM's DeepGEMM port: gpu_fp8_gemm.py's `flashinfer` peer; 62 s
here, and its kernels compile per shape with the GPU machine's nvcc at run time), and the fa2 prefill
module over an FP8 KV pool at d128 (offline FP8 + FP8 KV on the flashinfer backend, 48 s here; it
loaded and ran on an H100 on 2026-12-06). All 19 pack into 10.0 MB.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROOT = Path("/tmp/fi-chroot")
SITE = Path("/tmp/fi-site")  # /root/site in the chroot
WORK = Path("/tmp/fi-work")  # /work/main in the chroot
VENV = Path("/tmp/fi-venv311")
APT = Path("/tmp/fi-apt")
# /usr/include in the chroot: Debian 12's glibc 2.36 and Linux 6.1 headers (trixie's 2.41 includes
# bits/mathcalls-macros.h, and its linux-libc-dev keeps asm/ under /usr/lib/linux/uapi, paths the
# GPU's Ubuntu 24.04 (glibc 2.39) lacks: an object whose recorded headers are missing is rebuilt),
# plus gcc 13's libstdc++ headers from the chroot.
INCLUDE = Path("/tmp/fi-include")
PYENV = Path("/root/.pyenv")
CUDA_SYSTEM = Path("/usr/local/cuda-13.0")  # this machine's nvcc 13.0.88, from NVIDIA's wheels
CUDA = Path("/tmp/fi-cuda")  # a copy of it with cuRAND's headers (CUTLASS's tensor_fill.h includes them)
CURAND = "nvidia-curand==10.4.0.35"  # CUDA 13.0's
CUBLAS = "nvidia-cublas==13.0.2.14"  # its headers: FlashInfer's norm binding includes cublasLt.h
GPU_PY_INCLUDE = "/usr/include/python3.12"  # sysconfig's include dir of the GPU machine's python3
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
NVRTC = "nvidia-cuda-nvrtc==13.0.88"  # CUDA 13.0's
# driver functions FlashInfer's modules call (`nm -D --undefined-only` of the built .so): the stub libcuda defines them
DRIVER_FUNCTIONS = ["cuGetErrorString", "cuKernelGetName", "cuLibraryEnumerateKernels", "cuLibraryGetKernelCount",
                    "cuLibraryLoadData", "cuLibraryUnload"]

# (priority group, kind, args): kind "prefill" = gen_batch_prefill_module(backend, hd, swa, cap[, "e4m3":
# an FP8 KV pool]),
# "decode" = gen_batch_decode_module(hd, swa, cap), "sink" = gen_customize_batch_prefill_module with
# the sink wrapper's jit_args (backend, hd, swa), "norm" / "rope" / "act" (name), "gemm" (the one
# FlashInfer GEMM module built here, named for the reader).
MODULES: list[tuple[str, str, tuple]] = [
    # test_attention_features_gpu.py: ragged / paged prefill (fa3) at d128 and d256, windows and caps
    ("features", "prefill", ("fa3", 128, True, False)),
    ("features", "prefill", ("fa3", 128, False, True)),
    ("features", "prefill", ("fa3", 256, True, False)),
    ("features", "prefill", ("fa3", 256, True, True)),
    ("features", "prefill", ("fa3", 256, False, True)),
    ("features", "sink", ("fa3", 64, True)),
    ("features", "sink", ("fa3", 64, False)),
    # d128 decode (32 / 8 heads: tensor cores, the fa2 prefill module); the graph test's global layer
    ("features", "prefill", ("fa2", 128, True, False)),
    ("features", "prefill", ("fa2", 128, False, True)),
    ("features", "prefill", ("fa2", 128, False, False)),
    # d256 decode (16 / 8 heads: the decode module)
    ("features", "decode", (256, True, False)),
    ("features", "decode", (256, True, True)),
    ("features", "decode", (256, False, True)),
    # gpu_decode.py --phases jit: llama3-8b (d128, 32 / 8) and tiny (d64, 8 / 2), no window or cap
    ("jit", "norm", ()),
    ("jit", "act", ("silu",)),
    ("jit", "prefill", ("fa3", 128, False, False)),
    ("jit", "rope", ()),
    ("jit", "prefill", ("fa2", 64, False, False)),
    ("jit", "prefill", ("fa3", 64, False, False)),
    # rxf's GeluAndMul (Gemma)
    ("layers", "act", ("gelu_tanh",)),
    # offline FP8 on the flashinfer backend: an FP8 KV pool with bf16 queries takes fa2 (fa3 wants FP8
    # queries too), for the paged prefill and the tensor-core decode alike
    ("offline", "prefill", ("fa2", 128, False, False, "e4m3")),
    # gpu_fp8_gemm.py's `flashinfer` peer: TensorRT-LLM's DeepGEMM block-scaled FP8 GEMM for sm90
    ("fp8", "gemm", ("fp8_blockscale_sm90",)),
]


def sh(cmd: list[str] | str, **kw) -> None:
    print("+", cmd if isinstance(cmd, str) else " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, shell=isinstance(cmd, str), **kw)


def prepare() -> None:
    """The chroot with gcc 13 at the GPU's paths, FlashInfer at /root/site's layout, the venv."""
    (APT / "lists/partial").mkdir(parents=True, exist_ok=True)
    (APT / "cache/archives/partial").mkdir(parents=True, exist_ok=True)
    (APT / "sources.list").write_text("deb http://deb.debian.org/debian trixie main\n")
    opts = [f"-oDir::Etc::SourceList={APT}/sources.list", "-oDir::Etc::SourceParts=/nonexistent",
            f"-oDir::State::Lists={APT}/lists", f"-oDir::Cache={APT}/cache", "-oDir::State::status=/dev/null",
            "-oAPT::Install-Recommends=false"]
    sh(["apt-get", *opts, "update", "-q"])
    sh(["apt-get", *opts, "install", "-y", "-q", "--download-only", "g++-13", "libc6-dev", "coreutils", "dash",
        "libffi8"])  # libffi8: pyenv's Python (ctypes) needs it inside the chroot
    CHROOT.mkdir(exist_ok=True)
    for deb in sorted(glob.glob(f"{APT}/cache/archives/*.deb")):
        sh(["dpkg", "-x", deb, str(CHROOT)])
    for link, target in [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin"),
                         ("usr/local/cuda", "cuda-13.0")]:
        p = CHROOT / link
        if not p.is_symlink():
            p.parent.mkdir(parents=True, exist_ok=True)  # a fresh chroot has no usr/local
            p.symlink_to(target)
    for d in ["tmp", "dev", "proc", "root/site", "root/.pyenv", "work/main", "usr/local/cuda-13.0", str(VENV)[1:]]:
        (CHROOT / d).mkdir(parents=True, exist_ok=True)
    # gcc relocates to its own prefix: real copies of its programs and libraries under /opt/gcc give
    # /opt/gcc/lib/gcc/x86_64-linux-gnu/13/include, and /opt/gcc/include -> /usr/include gives
    # libstdc++'s /usr/include/c++/13 (gcc prints symlinked include dirs resolved), as on the GPU.
    opt = CHROOT / "opt/gcc"
    (opt / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(CHROOT / "usr/bin/x86_64-linux-gnu-gcc-13", opt / "bin/gcc")
    shutil.copy2(CHROOT / "usr/bin/x86_64-linux-gnu-g++-13", opt / "bin/g++")
    for sub in ["lib/gcc", "libexec/gcc"]:
        if not (opt / sub).exists():
            shutil.copytree(CHROOT / "usr" / sub, opt / sub, symlinks=True)
    if not (opt / "include").is_symlink():
        (opt / "include").symlink_to("/usr/include")
    # FlashInfer and tvm_ffi as gpu_session.sh installs them (their headers' old time included)
    whl = sorted(glob.glob(str(REPO / ".whl/flashinfer_python-*.whl")) + glob.glob(str(REPO / ".whl/apache_tvm_ffi-*.whl")))
    if not VENV.exists():
        sh([str(PYENV / "versions/3.11.7/bin/python"), "-m", "venv", str(VENV)])
        sh([str(VENV / "bin/pip"), "install", "-q", "torch==2.13.0", "numpy", "filelock", "packaging", "requests",
            "tqdm", "click", "einops", "tabulate", "nvidia-ml-py", "ninja==1.13.0"])
    # the GPU's Python is 3.12: the cp312 tvm_ffi wheel installs here only when pip is told so
    sh([str(VENV / "bin/pip"), "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
        "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
        "--platform", "manylinux_2_28_x86_64", "--target", str(SITE), *whl])
    sh([str(VENV / "bin/pip"), "download", "-q", "--no-deps", "--only-binary=:all:", "-d", "/tmp/fi-tvm311", TVM_FFI])
    sh(f"cd /tmp/fi-tvm311 && python3 -m zipfile -e apache_tvm_ffi-*cp311*.whl x && "
       f"cp x/tvm_ffi/core.cpython-311-x86_64-linux-gnu.so {SITE}/tvm_ffi/")
    sh(f"find {SITE}/flashinfer {SITE}/tvm_ffi -exec touch -h -d @946684800 {{}} +")
    if not INCLUDE.exists():
        debs = Path("/tmp/fi-bookworm")
        debs.mkdir(exist_ok=True)
        # this machine's Debian 12; its package lists first (a stale list names versions the mirror
        # no longer has: "Can't find a source to download version '6.1.187-1' of 'linux-libc-dev'")
        sh("apt-get update -q")
        sh("apt-get download libc6-dev linux-libc-dev libcrypt-dev", cwd=debs)
        for deb in sorted(glob.glob(f"{debs}/*.deb")):
            sh(["dpkg", "-x", deb, str(debs / "root")])
        shutil.move(debs / "root/usr/include", INCLUDE)
        shutil.copytree(CHROOT / "usr/include/c++", INCLUDE / "c++", symlinks=True)
        shutil.copytree(CHROOT / "usr/include/x86_64-linux-gnu/c++", INCLUDE / "x86_64-linux-gnu/c++", symlinks=True)
    if not CUDA.exists():
        sh(["cp", "-a", str(CUDA_SYSTEM), str(CUDA)])
        _wheel_files(CURAND, "include/*.h", "include")
        _wheel_files(CUBLAS, "include/*.h", "include")
        # nvrtc.h: the DeepGEMM sources of the FP8 block-scale GEMM module include it; its link line
        # names -lnvrtc (no symbol of it is used: --as-needed drops it again)
        _wheel_files(NVRTC, "include/nvrtc.h", "include")
        _wheel_files(NVRTC, "lib/libnvrtc.so.13", "lib64")
        (CUDA / "lib64/libnvrtc.so").unlink(missing_ok=True)
        (CUDA / "lib64/libnvrtc.so").symlink_to("libnvrtc.so.13")
    # -lcuda needs a libcuda.so to link against (the GPU machine's stubs/ has one). --as-needed, gcc's
    # default here as in Ubuntu's, drops it from a module that calls no driver function, as in the
    # GPU-built modules, and keeps it where one does: so the stub defines the driver functions the
    # modules call (the FP8 block-scale GEMM module's cuLibrary* calls), or the module loads with
    # them unresolved ("undefined symbol: cuLibraryLoadData" on the GPU).
    for stubs in ("lib/stubs", "lib64/stubs"):
        (CUDA / stubs).mkdir(parents=True, exist_ok=True)
    (CHROOT / "tmp/libcuda_stub.c").write_text("".join(f"void {name}(void) {{}}\n" for name in DRIVER_FUNCTIONS))
    sh(["chroot", str(CHROOT), "/opt/gcc/bin/gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", "/tmp/libcuda.so",
        "/tmp/libcuda_stub.c"])
    for stubs in ("lib/stubs", "lib64/stubs"):
        shutil.copy2(CHROOT / "tmp/libcuda.so", CUDA / stubs / "libcuda.so")


def _wheel_files(spec: str, pattern: str, dest: str) -> None:
    """Copy the files matching `pattern` under an NVIDIA wheel's nvidia/<pkg>/ into CUDA/`dest`."""
    tmp = Path("/tmp/fi-wheels") / spec.split("==")[0]
    if not tmp.exists():
        sh([str(VENV / "bin/pip"), "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(tmp), spec])
        sh(f"cd {tmp} && python3 -m zipfile -e *.whl x")
    sh(f"cp -p {tmp}/x/nvidia/*/{pattern} {CUDA}/{dest}/")


def enter(args: list[str]) -> None:
    """Run this script's `inner` step in the chroot, in a private mount namespace."""
    binds = [(SITE, "root/site"), (WORK, "work/main"), (PYENV, "root/.pyenv"), (VENV, str(VENV)[1:]),
             (CUDA, "usr/local/cuda-13.0"), (INCLUDE, "usr/include"), (Path("/dev"), "dev"), (REPO / "benchmarks", "tmp/fi-script")]
    (CHROOT / "tmp/fi-script").mkdir(exist_ok=True)
    mounts = "; ".join(f"mount --bind {src} {CHROOT}/{dst}" for src, dst in binds)
    env = {
        "PATH": f"{VENV}/bin:/usr/local/cuda/bin:/usr/bin:/bin", "HOME": "/root", "PYTHONPATH": "/root/site",
        "CUDA_HOME": "/usr/local/cuda", "CC": "/opt/gcc/bin/gcc", "CXX": "/opt/gcc/bin/g++",
        "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_WORKSPACE_BASE": "/work/main/.fi-cache",
        "MAX_JOBS": os.environ.get("MAX_JOBS", "2"), "PYTHONUNBUFFERED": "1",
    }
    env_args = " ".join(f"{k}={v}" for k, v in env.items())
    inner = " ".join([f"{VENV}/bin/python", "/tmp/fi-script/fi_cache_build.py", "inner", *args])
    script = (f"set -e; mount --make-rprivate /; {mounts}; mount -t proc proc {CHROOT}/proc; "
              f"exec chroot {CHROOT} /usr/bin/env -i {env_args} nice -n 10 {inner}")
    sh(["unshare", "-m", "sh", "-c", script])


def specs(only: list[str]):
    """(uri, JitSpec) in MODULES' order, from FlashInfer's generators."""
    import sysconfig

    real_get_path = sysconfig.get_path
    sysconfig.get_path = lambda name, *a, **k: GPU_PY_INCLUDE if name == "include" else real_get_path(name, *a, **k)
    import torch
    from flashinfer.jit import activation, norm, rope
    from flashinfer.jit.attention import modules
    from flashinfer.jit.attention.variants import attention_sink_decl
    from flashinfer.jit.utils import filename_safe_dtype_map

    bf16, i32 = torch.bfloat16, torch.int32
    for group, kind, a in MODULES:
        if kind == "prefill":
            backend, hd, swa, cap, *kv = a
            kv_dtype = torch.float8_e4m3fn if kv == ["e4m3"] else bf16
            spec = modules.gen_batch_prefill_module(backend, bf16, kv_dtype, bf16, i32, hd, hd, 0, swa, cap, False)
        elif kind == "decode":
            hd, swa, cap = a
            spec = modules.gen_batch_decode_module(bf16, bf16, bf16, i32, hd, hd, 0, swa, cap)
        elif kind == "sink":  # as BatchAttentionWithAttentionSinkWrapper.__init__ makes it (its URI)
            backend, hd, swa = a
            uri = f"batch_prefill_attention_sink_{filename_safe_dtype_map[bf16]}_swa_{swa}_{backend}"
            spec = modules.gen_customize_batch_prefill_module(
                backend, uri, bf16, bf16, bf16, i32, hd, hd, ["sink"], ["float"], ["sm_scale"], ["double"],
                "AttentionSink", attention_sink_decl[backend], 0, swa, False, False, False)
        elif kind == "norm":
            spec = norm.gen_norm_module()
        elif kind == "rope":
            spec = rope.gen_rope_module()
        elif kind == "gemm":
            from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module

            spec = gen_fp8_blockscale_gemm_sm90_module()
        else:
            spec = activation.gen_act_and_mul_module(a[0])
        if not only or any(s in spec.name for s in only):
            yield group, spec


def inner(only: list[str], force: bool, dry: bool) -> None:
    from flashinfer.jit.cpp_ext import generate_ninja_build_for_op

    for group, spec in specs(only):
        so = spec.jit_library_path
        if dry:  # and whether an existing build.ninja (the GPU's, say) is the one this build writes
            ninja = "no build.ninja"
            if spec.ninja_path.exists():
                ninja = "build.ninja " + ("same" if spec.ninja_path.read_text() == generate_ninja_build_for_op(
                    spec.name, spec.sources, spec.extra_cflags, spec.extra_cuda_cflags, spec.extra_ldflags,
                    spec.extra_include_dirs, spec.needs_device_linking) else "DIFFERS")
            print(f"{group:9s} {'built' if so.exists() else 'todo '} {spec.name} ({ninja})", flush=True)
            continue
        if so.exists() and not force:
            print(f"skip (built): {spec.name}", flush=True)
            continue
        start = time.time()
        print(f"build: {spec.name} ({len(spec.sources)} sources)", flush=True)
        try:
            spec.build(verbose=False)
            print(f"built: {spec.name} in {time.time() - start:.0f}s", flush=True)
        except Exception as e:
            print(f"FAILED: {spec.name} after {time.time() - start:.0f}s: ...{str(e)[-3000:]}", flush=True)


def pack(out: Path) -> None:
    """A snapshot of the work tree (a build may still run): a module without its .so keeps only its
    build.ninja (no half-written objects), then `tar cf - .fi-cache | xz | split -b 15M` (xz: 6x smaller
    than gzip on these modules)."""
    stage = Path("/tmp/fi-stage")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    shutil.copytree(WORK / ".fi-cache", stage / ".fi-cache", symlinks=True)
    for d in sorted(stage.glob(".fi-cache/.cache/flashinfer/*/*/cached_ops/*")):
        if d.name != "tmp" and not (d / f"{d.name}.so").exists():
            for f in d.iterdir():
                if f.name != "build.ninja":
                    f.unlink()
            print("not built:", d.name)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("fi-cache.t?z.part-*"):
        old.unlink()
    sh(f"cd {stage} && tar cf - .fi-cache | xz -T2 -6 | split -b 15M - {out}/fi-cache.txz.part- && ls -la {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "build", "list", "pack", "inner"])
    ap.add_argument("--only", nargs="*", default=[], help="URI substrings to build (default: all)")
    ap.add_argument("--restore", nargs="*", default=[], help="cache parts to unpack into the work tree first")
    ap.add_argument("--force", action="store_true", help="run ninja for modules whose .so exists too")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("/tmp/fi-parts-new"))
    args = ap.parse_args()
    if args.step == "prepare":
        prepare()
    elif args.step in ("build", "list"):
        WORK.mkdir(exist_ok=True)
        if args.restore:
            sh(f"cat {' '.join(args.restore)} | tar xzf - -C {WORK}")
        extra = [*(["--only", *args.only] if args.only else []), *(["--force"] if args.force else [])]
        enter([*extra, *(["--dry"] if args.step == "list" or args.dry else [])])
    elif args.step == "inner":
        inner(args.only, args.force, args.dry)
    else:
        pack(args.out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
