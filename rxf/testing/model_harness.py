"""Run a model plugin inside rxf's `ModelRunner` without the scheduler: logits for the comparison
with transformers, on the paged KV pool and the attention backend a deployment would use.

    harness = ModelHarness(checkpoint_dir, attention_backend="torch_native")
    harness.prefill_logits([[5, 80, 17], [400, 12]])   # per prompt, float32 [len, vocab]
    harness.greedy([[5, 80, 17]], 16)                   # prefill, then 15 DECODE steps

The registry defaults to every installed plugin (`PluginRegistry.load()`), so a plugin under test
must be installed (`pip install -e .`), or passed in a registry of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner

CPU_DEFAULTS: dict[str, Any] = {
    "runtime.device": "cpu",
    "runtime.cpu_compile": "off",  # eager decode unless a caller asks for the compiled one
    "model.dtype": "float32",
    "cache.max_total_tokens": 4096,
    "scheduler.max_running_requests": 8,
}


class ModelHarness:
    def __init__(
        self,
        path: str | Path,
        attention_backend: str = "torch_native",
        registry: PluginRegistry | None = None,
        thread_counts: tuple[int, ...] | None = None,
        **config_overrides: Any,
    ) -> None:
        """`thread_counts`: the torch thread counts the caller will run forwards at (CPU kernels are
        compiled for each; default: the current count)."""
        config = load_config(None, **{**CPU_DEFAULTS, "attention.backend": attention_backend, **config_overrides})
        self.runner = ModelRunner(config, registry or PluginRegistry.load(), str(path), thread_counts=thread_counts)

    def _start(self, prompts: list[list[int]]) -> tuple[list[int], list[torch.Tensor]]:
        """Fresh pools; one req_to_token row and len(prompt) KV slots per prompt."""
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool.clear()
        rows = [self.runner.req_to_token_pool.alloc() for _ in prompts]
        slots = [self.runner.token_to_kv_pool.alloc(len(p)) for p in prompts]
        if None in rows or any(s is None for s in slots):
            raise ValueError("prompts do not fit the harness's KV pool (raise cache.max_total_tokens)")
        return rows, slots

    def _prefill(self, prompts: list[list[int]], rows: list[int], slots: list[torch.Tensor], all_logits: bool):
        return self.runner.forward(
            ModelInput(
                ForwardMode.PREFILL,
                rows,
                [t for p in prompts for t in p],
                [0] * len(prompts),
                [len(p) for p in prompts],
                torch.cat(slots),
                logits_start=[0] * len(prompts) if all_logits else None,
            )
        )

    @torch.inference_mode()
    def prefill_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """One batched PREFILL; per prompt, float32 `[len(prompt), vocab]` logits of every position."""
        rows, slots = self._start(prompts)
        logits = self._prefill(prompts, rows, slots, all_logits=True)
        return list(logits.split([len(p) for p in prompts]))

    @torch.inference_mode()
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Argmax continuations of every prompt, batched: one PREFILL, then DECODE steps whose K/V
        come from the pool (EOS does not stop them)."""
        rows, slots = self._start(prompts)
        next_tokens = self._prefill(prompts, rows, slots, all_logits=False).argmax(-1).tolist()
        out = [[t] for t in next_tokens]
        lens = [len(p) for p in prompts]
        for _ in range(max_new_tokens - 1):
            new = self.runner.token_to_kv_pool.alloc(len(prompts))
            if new is None:
                raise ValueError("generation does not fit the harness's KV pool (raise cache.max_total_tokens)")
            logits = self.runner.forward(
                ModelInput(ForwardMode.DECODE, rows, next_tokens, list(lens), [1] * len(prompts), new)
            )
            lens = [n + 1 for n in lens]
            next_tokens = logits.argmax(-1).tolist()
            for seq, t in zip(out, next_tokens, strict=True):
                seq.append(t)
        return out
