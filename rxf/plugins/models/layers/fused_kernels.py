"""FlashInfer's fused elementwise kernels for the model layers, where they apply.

`flashinfer_for(x)` is the flashinfer package when `x` is a CUDA fp16/bf16 tensor and flashinfer
imports, else None: the layer then runs its torch code (CPU, float32, or no flashinfer), which is
also the reference the fused paths are tested against. flashinfer is imported on first use, never at
plugin import (plugins must not load kernel libraries or touch CUDA when they are imported).
FlashInfer compiles each kernel on its first call (cached under `$FLASHINFER_WORKSPACE_BASE`).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)  # the dtypes FlashInfer's norm/activation/rope kernels take


@functools.cache
def _flashinfer() -> ModuleType | None:
    try:
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope
    except Exception as e:  # ImportError, or a broken CUDA install found while importing
        logger.info("flashinfer unavailable (%s): model layers use their torch code", e)
        return None
    return flashinfer


def flashinfer_for(x: torch.Tensor) -> ModuleType | None:
    if not x.is_cuda or x.dtype not in _HALF:
        return None
    return _flashinfer()
