"""Logit penalties for one sampling step: repetition, frequency, presence and banned tokens.

Built per step from the requests' token histories (prompt and output ids as host lists). Rows whose
penalties are neutral contribute no indices, and every formula leaves a neutral row's logits
bit-for-bit unchanged, so a row's result never depends on what else is in the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from rxf.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _host_rows_and_ids(rows: list[int], id_lists: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattens the ids of `id_lists[j]` (several lists each) into (batch row, id) pairs on the host.

    Duplicates are kept: callers rely on them to count occurrences. numpy's fromiter reads the
    Python ints several times faster than torch.tensor(list), which matters for long prompts.
    """
    lengths = [sum(len(ids) for ids in lists) for lists in id_lists]
    flat_ids = chain.from_iterable(chain.from_iterable(id_lists))
    ids = np.fromiter(flat_ids, dtype=np.int64, count=sum(lengths))
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    return torch.from_numpy(row_of), torch.from_numpy(ids)


def _flat_positions(
    rows: list[int], id_lists: list[list[list[int]]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Positions in a flattened [bs * vocab] tensor of every id listed for each row, moved in one copy."""
    row_of, ids = _host_rows_and_ids(rows, id_lists)
    return (row_of * vocab_size + ids).to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(-1, 1).to(device)


@dataclass
class Penalties:
    """Device tensors for one step's penalties; each group is None when no row needs it."""

    # Repetition (CTRL/HF): positions (flat) of ids seen in prompt or output, and each one's factor.
    seen_positions: torch.Tensor | None
    seen_factors: torch.Tensor | None
    # Frequency/presence (OpenAI): per-row coefficients [bs, 1] and output-token counts [bs, vocab].
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    counts: torch.Tensor | None
    # Flat positions whose logits become -inf (EOS/stop ids while under min_new_tokens).
    banned_positions: torch.Tensor | None
    # OpenAI logit_bias: flat positions and the values added there (after the penalties).
    bias_positions: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        banned_ids: list[list[int]] | None,
        vocab_size: int,
        device: torch.device,
    ) -> Penalties | None:
        """Returns None when every row is neutral, so the sampler can skip this stage entirely."""
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq_rows = [
            i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        ban_rows = [i for i, ids in enumerate(banned_ids or []) if ids]
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if not (rep_rows or freq_rows or ban_rows or bias_rows):
            return None

        seen_positions = seen_factors = None
        if rep_rows:
            row_of, ids = _host_rows_and_ids(rep_rows, [[prompt_ids[i], output_ids[i]] for i in rep_rows])
            factors = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            seen_positions = (row_of * vocab_size + ids).to(device)
            seen_factors = factors[row_of].to(device)

        frequency = presence = counts = None
        if freq_rows:
            frequency = _column([p.frequency_penalty for p in params], device)
            presence = _column([p.presence_penalty for p in params], device)
            out_positions = _flat_positions(
                freq_rows, [[output_ids[i]] for i in freq_rows], vocab_size, device
            )
            counts = torch.zeros(len(params) * vocab_size, dtype=torch.float32, device=device)
            counts.scatter_add_(0, out_positions, torch.ones_like(out_positions, dtype=torch.float32))
            counts = counts.view(len(params), vocab_size)

        banned_positions = None
        if ban_rows:
            assert banned_ids is not None
            banned_positions = _flat_positions(
                ban_rows, [[banned_ids[i]] for i in ban_rows], vocab_size, device
            )

        bias_positions = bias_values = None
        if bias_rows:
            pairs = [(i * vocab_size + t, b) for i in bias_rows for t, b in params[i].logit_bias.items()]
            bias_positions = torch.tensor([q for q, _ in pairs], dtype=torch.int64).to(device)
            bias_values = torch.tensor([b for _, b in pairs], dtype=torch.float32).to(device)

        return cls(
            seen_positions, seen_factors, frequency, presence, counts, banned_positions, bias_positions, bias_values
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Returns penalized float32 logits [bs, vocab]; the input is not modified."""
        # Row-major, whatever the input's strides: positions index the flat buffer.
        out = logits.clone(memory_format=torch.contiguous_format)
        flat = out.view(-1)
        if self.seen_positions is not None and self.seen_factors is not None:
            # Gather from the unpenalized logits, so a duplicated id writes the same value each time:
            # the penalty is applied once per distinct token, whatever its count.
            vals = logits.reshape(-1).index_select(0, self.seen_positions)
            penalized = torch.where(vals > 0, vals / self.seen_factors, vals * self.seen_factors)
            flat.scatter_(0, self.seen_positions, penalized)
        if self.counts is not None and self.frequency is not None and self.presence is not None:
            out = out - (self.frequency * self.counts + self.presence * (self.counts > 0))
            flat = out.view(-1)
        if self.bias_positions is not None and self.bias_values is not None:
            flat.index_add_(0, self.bias_positions, self.bias_values)
        if self.banned_positions is not None:
            flat.index_fill_(0, self.banned_positions, float("-inf"))
        return out
