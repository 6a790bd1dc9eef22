"""Build a C++ file of torch ops once per machine and torch version, and load it into the process.

The file is compiled against torch's headers and libraries with the vector ISA Inductor picks for
this CPU (`torch._inductor.cpu_vec_isa`: AVX512, AVX2, NEON, ...; ATen's `at::vec` types follow
its macro) and with OpenMP (`at::parallel_for` then runs on the libgomp that torch loaded), into
`<rxf cache>/kernels/<stem>-<key>.so`, key: a hash of the source, torch's version and the CPU's
flags. A process that finds the library loads it in milliseconds; a build takes ~20 s of one core
on the 2-core VM. Concurrent builds (tests, engines starting together) wait on a file lock.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rxf.core.cache_dir import cache_dir

logger = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def library_path(source: Path) -> Path:
    key = hashlib.sha256(
        source.read_bytes() + torch.__version__.encode() + platform.machine().encode() + _cpu_flags().encode()
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


@functools.cache
def _compile_command(source: Path) -> tuple[str, ...]:
    """The compiler's arguments, less the output's `-o PATH`."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.utils.cpp_extension import include_paths, library_paths

    isa = pick_vec_isa()
    cmd = [os.environ.get("CXX") or shutil.which("g++") or "c++", str(source), "-shared", "-fPIC",
           "-O3", "-std=c++20", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cmd += [f"-D{macro}" for macro in isa.build_macro()] + isa.build_arch_flags().split()
    cmd += [f"-I{p}" for p in include_paths()]
    for lib in library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return (*cmd, "-lc10", "-ltorch_cpu")


def prepare_build(source: Path) -> None:
    """Work out the build command of `source` now, unless its library is cached. A thread that
    starts a build in the background calls this first: Inductor's ISA probe and torch's
    cpp_extension import torch._dynamo and torch._inductor, whose circular imports fail (a
    _DeadlockError in one thread, an ImportError of a half-initialized module in the other) when
    two threads run them at once, as a build thread did beside the compiled forward's torch.compile
    on a machine's first start (3 of 4 fresh starts)."""
    if not library_path(source).exists():
        try:
            _compile_command(source)
        except Exception:  # (e.g. no working compiler: the build raises it again, and its caller reports it)
            pass


def load_ops(source: Path) -> None:
    """Build `source` unless its library is cached, and load it (its TORCH_LIBRARY ops register).
    Raises when no compiler can build it."""
    lib = library_path(source)
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with open(lib.parent / f"{source.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():  # (another process may have built it meanwhile)
                with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                    built = Path(tmp) / lib.name
                    done = subprocess.run([*_compile_command(source), "-o", str(built)], capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-2000:]}")
                    os.replace(built, lib)
                logger.info("built %s", lib)
    torch.ops.load_library(str(lib))
