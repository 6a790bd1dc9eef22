"""Token embedding and the logits head.

Both hold a `[vocab, hidden]` weight; when a checkpoint ties them, the model makes the head share the
embedding's Parameter, so one tensor is loaded and `named_parameters()` lists it once. Vocab
sharding across tensor-parallel ranks would split that first dimension; with tp_size = 1 (all that
is wired today) each rank holds the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rxf.plugins.models.layers.linear import check_tp_size, copy_weight


class VocabEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_tp_size(tp_size, tp_rank)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        copy_weight(param.data, loaded, type(self).__name__)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LogitsHead(VocabEmbedding):
    """hidden `[n, hidden]` -> float32 logits `[n, vocab]`. Only the rows whose logits are returned
    should reach it: the vocab projection is the widest matmul of a decode step."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
