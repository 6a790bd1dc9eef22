"""What a model runner decides once, at start-up, from the configuration and the checkpoint: the
device, the dtype, the end-of-sequence ids, whether steps overlap, and the attention backend."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import GenerationConfig

from rxf.core.attention import AttentionBackend, AttentionLayer
from rxf.core.config import EngineConfig
from rxf.core.registry import PluginRegistry

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("runtime.device = 'cuda' but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def overlap_enabled(config: EngineConfig, device: torch.device) -> bool:
    """`scheduler.overlap`, or by default: on for CUDA, off on the CPU."""
    if config.scheduler.overlap is not None:
        return config.scheduler.overlap
    return device.type == "cuda"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): there oneDNN's bf16 matmuls
    beat fp32 (half the weight bytes per token; the demo model decodes ~2x faster, see
    benchmarks/RESULTS.md "CPU bf16"); elsewhere bf16 is emulated."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    ckpt = getattr(hf_config, "dtype", None)
    ckpt = getattr(torch, ckpt, None) if isinstance(ckpt, str) else ckpt
    half = ckpt in (torch.bfloat16, torch.float16)
    if device.type != "cuda":  # a half-precision checkpoint in bf16 where the CPU has it, else fp32
        return torch.bfloat16 if half and cpu_has_native_bf16() else torch.float32
    return ckpt if half else torch.bfloat16


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(model_path: str, hf_config: Any) -> list[int]:
    """generation_config.json first (chat models list their end-of-turn token there), then config."""
    ids: list[int] = []
    try:
        ids += _as_list(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:
        logger.debug("no generation_config.json in %s", model_path)
    ids += _as_list(getattr(hf_config.get_text_config(), "eos_token_id", None))
    ids += _as_list(getattr(hf_config, "eos_token_id", None))
    return list(dict.fromkeys(ids))


def _feature_gaps(cls: type[AttentionBackend], layers: list[AttentionLayer]) -> str:
    """What `cls` lacks for these layers, as words ("" when nothing): "sinks (layers 0, 2)"."""
    missing = cls.missing_features(layers)
    return "; ".join(f"{name} (layers {', '.join(map(str, ids))})" for name, ids in missing.items())


def select_attention_backend(
    registry: PluginRegistry, name: str, device: torch.device, layers: list[AttentionLayer], fp8_kv: bool = False
) -> type[AttentionBackend]:
    """A named backend, or for "auto" the available backend with the highest `auto_priority` among
    those that implement every optional feature (`AttentionBackend.features`) the model's layers use
    and, with `fp8_kv` (an FP8 pool), read FP8 K/V. A named backend that lacks one is refused: it
    would compute different attention."""
    if name != "auto":
        cls = registry.attention_backend(name)
        if not cls.is_available(device):
            raise RuntimeError(f"attention backend {name!r} is not available on {device}")
        if fp8_kv and not cls.fp8_kv:
            raise RuntimeError(
                f"attention backend {name!r} cannot use an FP8 KV cache (cache.kv_dtype); choose another "
                "attention.backend (torch_native, triton and flashinfer can) or cache.kv_dtype = 'auto'"
            )
        gaps = _feature_gaps(cls, layers)
        if gaps:
            raise RuntimeError(
                f"attention backend {name!r} does not implement what this model's layers need: {gaps}; "
                "choose another attention.backend (torch_native implements every feature)"
            )
        return cls
    candidates = []
    for candidate in registry.names("attention_backends"):
        try:
            cls = registry.attention_backend(candidate)
        except Exception as e:  # e.g. a GPU backend whose kernel library is not installed
            logger.info("attention backend %s skipped: %s", candidate, e)
            continue
        if cls.auto_priority is None or not cls.is_available(device):
            continue
        if fp8_kv and not cls.fp8_kv:
            logger.info("attention backend %s skipped: it cannot use an FP8 KV cache", candidate)
            continue
        gaps = _feature_gaps(cls, layers)
        if gaps:
            logger.info("attention backend %s skipped: it does not implement %s", candidate, gaps)
            continue
        candidates.append((cls.auto_priority, candidate, cls))
    if not candidates:
        raise RuntimeError(f"no attention backend available on {device} implements this model's attention")
    priority, chosen, cls = max(candidates, key=lambda c: (c[0], c[1]))
    logger.info("attention backend: %s (auto, priority %s)", chosen, priority)
    return cls
