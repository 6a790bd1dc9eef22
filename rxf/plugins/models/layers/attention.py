"""The attention module models call: a thin handle that forwards to the batch's attention backend.

It satisfies `rxf.core.attention.AttentionLayer` (what a backend may read off a layer, including the
optional sliding window, logit soft-cap and sinks; see there for their meanings) and owns no weights:
the projections, rotary embedding and any learned sinks live in the model's attention block around it
(a sinks parameter handed in stays the block's, loaded under the block's name). Its one state is the
pair of KV-cache scales `k_scale` / `v_scale` (buffers, 1.0 unless the checkpoint has them:
`load_named_weights` routes a checkpoint's `self_attn.k_scale`-style tensors here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rxf.core.attention import Rotary
    from rxf.core.forward import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float | None = None,
        *,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"layer {layer_id}: sliding_window {sliding_window} must be at least 1")
        if logit_cap is not None and not logit_cap > 0:
            raise ValueError(f"layer {layer_id}: logit_cap {logit_cap} must be positive")
        if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32):
            raise ValueError(
                f"layer {layer_id}: sinks must be float32 [{num_heads}] (one per query head on this rank), "
                f"got {sinks.dtype} {list(sinks.shape)}"
            )
        self.layer_id = layer_id  # index into the KV pool's per-layer buffers
        self.num_heads = num_heads  # per tensor-parallel rank
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        # A plain attribute, not a registered parameter or buffer: the block that owns the weight
        # loads it (an nn.Parameter assigned here would register a second name for it).
        object.__setattr__(self, "sinks", sinks)
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, rotary: Rotary | None = None
    ) -> torch.Tensor:
        """q `[n, heads * head_dim]`, k/v `[n, kv_heads * head_dim]` -> `[n, heads * head_dim]`.

        With `rotary`, q and k are unrotated: the backend rotates them inside its K/V store when it
        can (`fuses_rope`), else they are rotated here first. Either way q and k may be overwritten.
        """
        backend = batch.attn_backend
        if rotary is not None and not backend.fuses_rope(rotary):
            q, k = rotary(batch.positions, q, k)
            rotary = None
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if rotary is None:
            return backend.forward(q, k, v, self, batch).flatten(-2)
        return backend.forward(q, k, v, self, batch, rotary=rotary).flatten(-2)
