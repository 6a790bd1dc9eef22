"""`batched_sdpa`: an attention backend that runs each layer's extend attention as ONE padded
`scaled_dot_product_attention` call for the whole batch, where rxf's reference backend
(`torch_native`) loops over requests. Many short prompts then cost one kernel launch per layer.

Select it with `attention.backend = "batched_sdpa"` (it never wins `auto`). It follows
`rxf.core.attention.AttentionBackend`'s contract: the new tokens' K/V are written into the pool at
`batch.out_cache_loc`, then each request attends over its whole sequence through `req_to_token`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rxf.core.attention import AttentionBackend, AttentionContext, AttentionLayer
from rxf.core.forward import ForwardBatch


class BatchedSDPABackend(AttentionBackend):
    auto_priority = None  # opt-in by name only

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        # Planned once per forward by init_forward_metadata, shared by all layers:
        self._slots = torch.empty(0, 0, dtype=torch.int64)  # [bs, max_seq] KV slots (0 where padding)
        self._mask = torch.empty(0, 0, 0, dtype=torch.bool)  # [bs, max_q, max_seq] True: may attend
        self._q_index = (torch.empty(0, dtype=torch.int64),) * 2  # (row, column) of each new token

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        max_seq = max(batch.seq_lens_cpu)
        max_q = max(batch.extend_lens_cpu)
        key_pos = torch.arange(max_seq, device=device)
        valid = key_pos[None, :] < batch.seq_lens[:, None]  # [bs, max_seq]
        # Columns past a request's seq_len may hold a previous occupant's slots: use slot 0 (reserved,
        # always a valid index) and mask them out.
        rows = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :max_seq]
        self._slots = torch.where(valid, rows, 0).to(torch.int64)
        # New token j of request i sits at position prefix_lens[i] + j and sees keys up to it. Padding
        # queries (j >= extend_lens[i]) then see every valid key: never an all-masked row (SDPA would
        # return NaN), and their outputs are dropped.
        query_pos = batch.prefix_lens[:, None] + torch.arange(max_q, device=device)[None, :]  # [bs, max_q]
        self._mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & valid[:, None, :]
        row = torch.repeat_interleave(torch.arange(batch.batch_size, device=device), batch.extend_lens)
        starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        col = torch.arange(batch.num_tokens, device=device) - torch.repeat_interleave(starts, batch.extend_lens)
        self._q_index = (row, col)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        bs, max_seq = self._slots.shape
        keys = k_buf[self._slots].to(q.dtype).transpose(1, 2)  # [bs, kv_heads, max_seq, head_dim]
        values = v_buf[self._slots].to(q.dtype).transpose(1, 2)
        q_pad = q.new_zeros(bs, self._mask.shape[1], layer.num_heads, layer.head_dim)
        q_pad[self._q_index] = q
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),  # [bs, heads, max_q, head_dim]
            keys,
            values,
            attn_mask=self._mask[:, None],  # broadcast over heads
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return out.transpose(1, 2)[self._q_index]  # back to [num_tokens, heads, head_dim]

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, batch)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        # Decode is extend with one new token per request: the same padded call (max_q = 1).
        return self._attend(q, k, v, layer, batch)
