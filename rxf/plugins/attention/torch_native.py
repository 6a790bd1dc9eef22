"""The reference attention backend: plain PyTorch over K/V gathered from the paged pool.

Runs on any device torch runs on. It favours being obviously correct over being fast (a Python loop
over requests for extend, one gather of every request's K/V per layer); every other backend is
tested against it. A layer with no optional feature goes through SDPA (which may pick a fused
kernel); a layer with a sliding window, a logit soft-cap or sinks goes through `explicit_attention`,
the features' definitions written out in float32. An FP8 pool is quantized on store and dequantized
on read by the pool's own definition (`TokenToKVPool.set_kv` / `read_kv`), which the other backends'
kernels must match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rxf.core.attention import (
    ATTENTION_FEATURES,
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    layer_features,
)

if TYPE_CHECKING:
    from rxf.core.forward import ForwardBatch


def visible_keys(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """bool [len(query_pos), num_keys]: key j is visible to the query at position i iff j <= i and,
    with a window W, i - W < j."""
    key_pos = torch.arange(num_keys, device=query_pos.device)[None, :]
    visible = key_pos <= query_pos[:, None]
    if window is not None:
        visible &= key_pos > query_pos[:, None] - window
    return visible


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, layer: AttentionLayer
) -> torch.Tensor:
    """q [..., H, M, D], k/v [..., Hkv, N, D], visible bool broadcastable to [..., H, M, N] -> [..., H, M, D]
    in q's dtype, computed in float32: scores scaled, soft-capped (logit_cap), masked, then a softmax
    whose denominator also holds exp(sink) of the query's head (sinks). Every row must see a key."""
    group = layer.num_heads // layer.num_kv_heads
    k = k.float().repeat_interleave(group, dim=-3)
    v = v.float().repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.transpose(-1, -2)) * layer.scaling
    if layer.logit_cap is not None:
        scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if layer.sinks is None:
        probs = scores.softmax(-1)
    else:  # the sink is one more logit per head that takes a share of the softmax but adds no value
        sink = layer.sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).to(q.dtype)


class TorchNativeBackend(AttentionBackend):
    auto_priority = 0  # the fallback: any accelerated backend that is available ranks above it
    features = frozenset(ATTENTION_FEATURES)
    fp8_kv = True
    verifies_as_decode = True

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        # Planned by init_forward_metadata, shared by all layers of one forward:
        self._slots = torch.empty(0, 0, dtype=torch.int64)  # [bs, max_seq_len] KV slots, 0 as padding
        self._valid = torch.empty(0, 0, dtype=torch.bool)  # [bs, max_seq_len] True where a real token
        self._query_pos: list[torch.Tensor] = []  # extend: per request, its new tokens' positions

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # Columns past a request's seq_len may hold stale slots from the row's earlier occupant: they
        # are replaced by slot 0 (reserved, always a valid index) and masked out.
        max_len = max(batch.seq_lens_cpu)
        device = batch.seq_lens.device
        rows = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :max_len]
        self._valid = torch.arange(max_len, device=device)[None, :] < batch.seq_lens[:, None]
        self._slots = torch.where(self._valid, rows, 0).to(torch.int64)
        self._query_pos = []
        if batch.mode.is_decode():
            return
        # New token j of a request sits at absolute position prefix_len + j.
        for prefix_len, extend_len in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True):
            self._query_pos.append(prefix_len + torch.arange(extend_len, device=device))

    def _store_kv(self, layer: AttentionLayer, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        batch.token_to_kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)

    @staticmethod
    def _read_kv(
        layer: AttentionLayer, batch: ForwardBatch, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at `slots` in `dtype`, dequantized when the pool is FP8: every key attended, the new
        tokens' too, is read back from the pool, so a token's attention does not depend on whether
        its keys were computed in this forward or cached."""
        return batch.token_to_kv_pool.read_kv(layer.layer_id, slots, dtype, layer.k_scale, layer.v_scale)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self._store_kv(layer, batch, k, v)
        plain = not layer_features(layer)
        out = torch.empty_like(q)
        start = 0
        for i, (prefix_len, extend_len, seq_len) in enumerate(
            zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, batch.seq_lens_cpu, strict=True)
        ):
            qi = q[start : start + extend_len].transpose(0, 1)  # [heads, extend_len, head_dim]
            ki, vi = self._read_kv(layer, batch, self._slots[i, :seq_len], q.dtype)
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            if plain and prefix_len == 0:  # plain causal: SDPA's is_causal, which lets it pick a fused kernel
                o = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads
                )
            else:
                visible = visible_keys(self._query_pos[i], seq_len, layer.sliding_window)
                o = self._attend(qi, ki, vi, visible, layer, plain)
            out[start : start + extend_len] = o.transpose(0, 1)
            start += extend_len
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self._store_kv(layer, batch, k, v)
        k_all, v_all = self._read_kv(layer, batch, self._slots, q.dtype)  # [bs, max_seq_len, kv_heads, head_dim]
        visible = self._valid
        if layer.sliding_window is not None:  # the new token sits at position seq_len - 1
            first = batch.seq_lens[:, None] - layer.sliding_window
            visible = visible & (torch.arange(visible.shape[1], device=visible.device)[None, :] >= first)
        # One batched call: keys padded to the longest sequence, padding masked per request.
        o = self._attend(
            q.unsqueeze(2),  # [bs, heads, 1, head_dim]
            k_all.transpose(1, 2),  # [bs, kv_heads, max_seq_len, head_dim]
            v_all.transpose(1, 2),
            visible[:, None, None, :],
            layer,
            not layer_features(layer),
        )
        return o.squeeze(2)

    @staticmethod
    def _attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, layer: AttentionLayer, plain: bool
    ) -> torch.Tensor:
        if not plain:
            return explicit_attention(q, k, v, visible, layer)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads
        )
