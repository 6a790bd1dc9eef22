"""Bidirectional attention inside multimodal items (Gemma 3's images), over any attention backend.

Gemma 3 lets the tokens of one image attend to each other in both directions; everything else is
causal (transformers builds the mask from `token_type_ids`: causal OR same image on global layers,
(causal OR same image) AND the window on local ones). Attention backends compute causal attention
only. So a model lets the backend run as usual — it stores every new token's K/V in the pool and
attends causally — and then recomputes, here, the output rows of the items' tokens in this forward
over the pool: query position p of an item spanning [s, e) sees the keys [max(0, p - W + 1), e),
W being the layer's window (none: [0, e)). That costs the item rows only (tokens per image x
context, per layer, in EXTEND forwards that carry such items); decode steps never do it.

This is exact only if each item's K/V is computed with the whole item present. The scheduler keeps
that (`Req.chunk_len`: a prefill chunk never ends inside a bidirectional item); a cached prefix that
ends inside an item was computed by a forward that held the whole item, so its keys are already
what bidirectional attention made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rxf.plugins.models.llava_features import needed_items

if TYPE_CHECKING:
    from rxf.core.attention import Rotary
    from rxf.core.forward import ForwardBatch
    from rxf.plugins.models.layers.attention import RadixAttention


@dataclass(frozen=True)
class _Block:
    rows: slice  # the item's new tokens in the flattened batch
    first: int  # absolute position of its first new token
    key_slots: torch.Tensor  # KV slots of the request's positions [0, item end)


class BidirectionalBlocks:
    """The bidirectional items of one EXTEND forward (built once, shared by every layer)."""

    def __init__(self, blocks: list[_Block], device: torch.device) -> None:
        self.blocks = blocks
        self.rows = torch.cat([torch.arange(b.rows.start, b.rows.stop) for b in blocks]).to(device)

    @classmethod
    def of(cls, batch: ForwardBatch) -> BidirectionalBlocks | None:
        if batch.mm_items is None or not batch.mode.is_extend():
            return None
        blocks = []
        table = batch.req_to_token_pool.req_to_token  # already holds this forward's new slots
        row = 0
        for req_row, items, prefix, n in zip(
            batch.req_pool_indices.tolist(), batch.mm_items, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True
        ):
            for r, item, lo, hi in needed_items([items], [prefix], [n]):
                if item.bidirectional:
                    end = item.offset + item.length
                    blocks.append(_Block(slice(row + r, row + r + hi - lo), item.offset + lo, table[req_row, :end].long()))
            row += n
        return cls(blocks, batch.positions.device) if blocks else None

    def queries(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """The rotated queries of the items' rows, `[rows, heads * head_dim]`, taken before the
        backend runs (it may rotate q in place, or not: this copy does not depend on it)."""
        q_rows, _ = rotary(positions[self.rows], q[self.rows], k[self.rows])  # indexing copies
        return q_rows

    def attend(self, q_rows: torch.Tensor, layer: RadixAttention, batch: ForwardBatch, out: torch.Tensor) -> None:
        """Overwrite the items' rows of the backend's causal output `out` [n, heads * head_dim]."""
        k_buf, v_buf = batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        heads, d = layer.num_heads, layer.head_dim
        window = layer.sliding_window
        start = 0
        for block in self.blocks:
            n = block.rows.stop - block.rows.start
            q = q_rows[start : start + n].view(n, heads, d).transpose(0, 1).float()  # [heads, n, d]
            start += n
            first_key = 0 if window is None else max(0, block.first - window + 1)
            slots = block.key_slots[first_key:]
            k = k_buf[slots].transpose(0, 1).float()  # [kv_heads, keys, d]
            v = v_buf[slots].transpose(0, 1).float()
            groups = heads // layer.num_kv_heads
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            scores = q @ k.transpose(1, 2) * layer.scaling  # [heads, n, keys]
            if layer.logit_cap is not None:
                scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
            if window is not None:  # key j is seen by query p when j > p - window (and j < item end)
                q_pos = block.first + torch.arange(n, device=q.device)
                k_pos = first_key + torch.arange(slots.numel(), device=q.device)
                scores = scores.masked_fill(k_pos[None, None, :] <= (q_pos[None, :, None] - window), float("-inf"))
            o = torch.softmax(scores, dim=-1) @ v  # [heads, n, d]
            out[block.rows] = o.transpose(0, 1).reshape(n, heads * d).to(out.dtype)
