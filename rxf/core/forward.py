"""Forward modes and the batch a model forward consumes.

The scheduler deals in requests, slot indices and token counts (CPU-side); `ModelRunner` alone turns
its batch into a `ForwardBatch` of device tensors. Attention backends and models read only this.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rxf.core.attention import AttentionBackend
    from rxf.core.ipc.messages import MultimodalItem
    from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool


class ForwardMode(IntEnum):
    PREFILL = auto()  # no request has a cached prefix
    EXTEND = auto()  # cached prefix + new tokens: q covers only the new tokens
    DECODE = auto()  # exactly one new token per request
    MIXED = auto()  # reserved: extend and decode requests in one batch
    IDLE = auto()  # reserved: a rank with nothing to run (tensor/data parallel)

    def is_extend(self) -> bool:
        """PREFILL is EXTEND with every prefix length zero; backends treat them alike."""
        return self in (ForwardMode.PREFILL, ForwardMode.EXTEND)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One forward's inputs. Token-level tensors are flattened over the batch in request order.

    Region map of request i (extend): its tokens [0, prefix_lens[i]) are already in the KV pool and
    listed in `req_to_token[req_pool_indices[i], :prefix_lens[i]]`; its new tokens
    [prefix_lens[i], seq_lens[i]) are in `input_ids` and get the slots `out_cache_loc`, which the
    runner has also written into `req_to_token` before the forward. Decode: extend_lens are all 1.
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64, new tokens only
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each new token
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int32, prefix + new tokens
    prefix_lens: torch.Tensor  # [bs] int32, tokens already in the pool
    extend_lens: torch.Tensor  # [bs] int32, new tokens (1 for decode)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, the KV slot each new token is written to
    # The same lengths on the host, so backends can plan without a device sync.
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Rows of the flattened token dimension whose logits the model returns, in order
    # (the last token of each request, plus every prompt token of requests asking prompt logprobs).
    logits_indices: torch.Tensor  # [num_logits] int64
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    # Extend only: per request, its images/videos (`MultimodalItem`s, None for text-only requests);
    # an item's tokens are prompt positions [offset, offset + length).
    mm_items: list[list[MultimodalItem] | None] | None = None
    # EAGLE-3 draft heads only: the hidden state each new token's row is fed (the target's auxiliary
    # hidden states, or the head's own feature of the step before), [num_tokens, width].
    spec_hidden: torch.Tensor | None = None
    # Set by the forward, not the runner: a target capturing auxiliary hidden states puts them here
    # (one row per new token), and a draft head its features (one row per logits row).
    aux_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
