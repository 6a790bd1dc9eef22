"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's decoder with the projections fused in the checkpoint.

The module structure is Llama's (`rxf.plugins.models.llama`): pre-norm blocks, SiLU gated MLP, no
biases. What differs is the checkpoint and the config:

- `model.layers.{i}.self_attn.qkv_proj.weight` holds q | k | v stacked on the output dimension and
  `mlp.gate_up_proj.weight` holds gate | up. Each is cut into its projections (views, no copy) and
  every piece goes through the fused parameter's shard loader, which takes this rank's rows of it,
  so tensor parallelism splits each of q, k, v, gate and up across ranks (not the stacked rows).
- longrope scaling (`su` in early configs) and `partial_rotary_factor` (Phi-4-mini: 0.75) are the
  shared rotary embedding's (`layers/rope_scaling.py`); Phi-4-mini also ties its embeddings.
- `sliding_window` on every layer (Phi-3-mini-4k: 2047 of 4096 positions; W keys including the
  query's own, as transformers counts), through the attention backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rxf.plugins.models.llama import LlamaForCausalLM, head_dim_of


def _split_fused(config: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each fused `qkv_proj` / `gate_up_proj` one cut into the
    per-projection tensors (`q_proj`, ..., `up_proj`) that Llama's loader maps onto its shards."""
    head_dim = head_dim_of(config)
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    inter = config.intermediate_size
    cuts = {
        ".qkv_proj.": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
        ".gate_up_proj.": (("gate_proj", "up_proj"), [inter, inter]),
    }
    for name, tensor in weights:
        fused = next((part for part in cuts if part in name), None)
        if fused is None:
            yield name, tensor
            continue
        parts, sizes = cuts[fused]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"checkpoint tensor {name}: {tensor.shape[0]} rows, the config implies {sum(sizes)}")
        for part, piece in zip(parts, tensor.split(sizes), strict=True):
            yield name.replace(fused, f".{part}."), piece


class Phi3ForCausalLM(LlamaForCausalLM):
    """Every layer attends through `sliding_window` when the config sets one (Llama's
    `sliding_windows`), as transformers' Phi3Attention does."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_split_fused(self.config, weights))
