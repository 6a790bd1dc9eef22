"""The batched sampler run once per scheduler step (a request's parameters: `sampling_params.py`).

`SamplingBatch` is built by the model runner each step from the step's sampled requests and turns
the model's last-position logits into next tokens without any device-to-host synchronisation: its
host-to-device copies are non-blocking (from pageable memory they are staged before the call
returns) and nothing is read back. The runner reads the step's results in one transfer
(`rxf.core.runner.step_runner`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rxf.core.runner.argmax import row_argmax
from rxf.core.runner.penalties import Penalties
from rxf.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Temperatures below this are raised to it before dividing, so logits / T stays finite in float32.
# At that scale the distribution is already a point mass except between near-exact ties.
_MIN_TEMPERATURE = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` (where the sampler draws its noise), seeded once per request."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    raw_logits: torch.Tensor  # [bs, vocab] float32, before penalties (may alias the model's output)

    @functools.cached_property
    def logprobs(self) -> torch.Tensor:
        """[bs, vocab] float32 log_softmax of the raw logits, computed on first access: a step in
        which no request asked for logprobs never pays for it."""
        return torch.log_softmax(self.raw_logits, dim=-1)


def _to_device(values: list[float] | list[int] | list[bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _column(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to_device(values, dtype, device).view(-1, 1)


@dataclass
class GrammarMask:
    """A step's token bitmask for its constrained rows (structured output): the scheduler fills it
    on the host, the runner moves it to the logits' device before sampling.

    When sampling, `bitmask` is on the logits' device; `apply(logits, bitmask, rows)` sets the
    disallowed logits of `rows` to -inf in place (the grammar backend's kernel); other rows are
    untouched.
    """

    bitmask: torch.Tensor
    rows: list[int]
    apply: Callable[[torch.Tensor, torch.Tensor, list[int]], None]


@dataclass
class SamplingBatch:
    """Per-row parameter tensors for one step. A filter is None when no sampled row uses it.

    Invariant: a row's neutral settings (top_k = vocab, top_p = inf, min_p = 0, no penalty) are exact
    no-ops, so a seeded row draws the same token whatever the rest of the batch needs.
    """

    vocab_size: int
    temperatures: torch.Tensor  # [bs, 1] float32; 1.0 on greedy rows (their draw is discarded)
    greedy: torch.Tensor | None  # [bs] bool; None when no row is greedy
    all_greedy: bool
    top_ks: torch.Tensor | None  # [bs, 1] int64
    top_ps: torch.Tensor | None  # [bs, 1] float32
    min_ps: torch.Tensor | None  # [bs, 1] float32
    penalties: Penalties | None
    any_unseeded: bool  # some sampled row draws from the global RNG
    seeded_rows: torch.Tensor | None  # [n_seeded] int64 row indices, aligned with `generators`
    generators: list[torch.Generator]
    grammar_mask: GrammarMask | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        banned_ids: list[list[int]] | None = None,
        grammar_mask: GrammarMask | None = None,
    ) -> SamplingBatch:
        """Host-side work only (lists to tensors, one copy each); `generators[i]` must live on `device`."""
        bs = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(generators) == bs) or (
            banned_ids is not None and len(banned_ids) != bs
        ):
            raise ValueError("SamplingBatch.build: per-row arguments must all have one entry per request")
        device = torch.device(device)
        greedy: list[bool] = []
        temperatures: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        seeded: list[int] = []
        for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
            g = p.is_greedy
            greedy.append(g)
            # Greedy rows get neutral settings: their draw is computed but discarded.
            temperatures.append(1.0 if g else max(p.temperature, _MIN_TEMPERATURE))
            top_ks.append(p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size)
            top_ps.append(p.top_p if p.top_p < 1 and not g else math.inf)
            min_ps.append(0.0 if g else p.min_p)
            if gen is not None and not g:
                seeded.append(i)
        return cls(
            vocab_size=vocab_size,
            temperatures=_column(temperatures, torch.float32, device),
            greedy=_to_device(greedy, torch.bool, device) if any(greedy) else None,
            all_greedy=all(greedy),
            top_ks=_column(top_ks, torch.int64, device) if any(k < vocab_size for k in top_ks) else None,
            top_ps=_column(top_ps, torch.float32, device) if any(p < 1 for p in top_ps) else None,
            min_ps=_column(min_ps, torch.float32, device) if any(p > 0 for p in min_ps) else None,
            penalties=Penalties.build(params, prompt_ids, output_ids, banned_ids, vocab_size, device),
            any_unseeded=len(seeded) < greedy.count(False),
            seeded_rows=_to_device(seeded, torch.int64, device) if seeded else None,
            generators=[gen for gen in (generators[i] for i in seeded) if gen is not None],
            grammar_mask=grammar_mask,
        )

    def sample(self, logits: torch.Tensor) -> SampleOutput:
        """Order per row: penalties -> grammar mask -> (greedy: argmax) -> temperature -> top_k -> top_p
        -> min_p -> draw. A masked token's probability is exactly 0, so no filter or draw can pick it."""
        bs = self.temperatures.shape[0]
        if tuple(logits.shape) != (bs, self.vocab_size):
            raise ValueError(
                f"SamplingBatch.sample: logits shape {tuple(logits.shape)} != ({bs}, {self.vocab_size})"
            )
        raw = logits.float().contiguous()  # penalties index it as a flat row-major buffer
        penalized = self.penalties.apply(raw) if self.penalties is not None else raw
        if self.grammar_mask is not None:
            if penalized is raw:  # raw_logits stay unmasked: logprobs report the model's distribution
                penalized = raw.clone()
            self.grammar_mask.apply(penalized, self.grammar_mask.bitmask, self.grammar_mask.rows)
        if self.all_greedy:
            return SampleOutput(row_argmax(penalized), raw)
        probs = self._filter(torch.softmax(penalized / self.temperatures, dim=-1))
        next_ids = self._draw(probs)
        if self.greedy is not None:
            next_ids = torch.where(self.greedy, row_argmax(penalized), next_ids)
        return SampleOutput(next_ids, raw)

    def _filter(self, probs: torch.Tensor) -> torch.Tensor:
        """Zeroes the probabilities of tokens excluded by top_k, top_p and min_p (left unnormalised)."""
        if self.top_ks is None and self.top_ps is None:
            if self.min_ps is None:
                return probs
            return probs.masked_fill(probs < self.min_ps * probs.amax(dim=-1, keepdim=True), 0.0)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if self.top_ks is not None:
            ranks = torch.arange(self.vocab_size, device=probs.device).view(1, -1)
            drop |= ranks >= self.top_ks
            # top_p then sees the top-k distribution renormalised (comparing against its total).
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        if self.top_ps is not None:
            cumulative = sorted_probs.cumsum(dim=-1)
            # Keep a token iff the mass strictly before it is < top_p: the smallest prefix reaching
            # top_p; top_p = inf keeps everything. The top token (mass before it 0) stays even where a
            # valid top_p rounds to 0 in float32 (1e-300): a row of zeros would draw token 0.
            drop |= (cumulative - sorted_probs) >= self.top_ps * cumulative[:, -1:]
            drop[:, 0] = False
        if self.min_ps is not None:
            # A ratio to the top token's probability, so renormalisation after top_k/top_p cannot change it.
            drop |= sorted_probs < self.min_ps * sorted_probs[:, :1]
        # Back to vocab order: the draw must not depend on whether this batch sorted.
        return probs.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), 0.0)

    def _own_noise(self, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """A fresh [vocab] Exp(1) draw: its values depend only on that request's generator state, never
        on the row's position or the batch's shape."""
        return torch.empty(self.vocab_size, dtype=torch.float32, device=device).exponential_(
            generator=generator
        )

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i / sum(p)."""
        noise = torch.empty_like(probs)
        if self.any_unseeded:
            noise.exponential_()
        else:
            noise.fill_(1.0)
        if self.seeded_rows is not None:
            noise.index_copy_(
                0, self.seeded_rows, torch.stack([self._own_noise(g, probs.device) for g in self.generators])
            )
        # Exp(1) can round to 0; 0/0 would be NaN and argmax favours NaN, so keep the divisor positive.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)


def pack_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """float64 `[n, 1 + 2 * k_max]` on the device: per row the chosen token's logprob, then the top
    k_max logprobs (best first), then their token ids (exact in float64 below 2**53). One tensor, so a
    single device-to-host copy serves the whole batch (`unpack_logprobs` reads it back)."""
    n = logprobs.shape[0]
    if len(top_k) != n or token_ids.shape != (n,):
        raise ValueError("pack_logprobs: token_ids and top_k need one entry per logprobs row")
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(torch.int64)).double()
    k_max = min(max(top_k, default=0), logprobs.shape[1])
    if k_max <= 0:
        return chosen
    values, ids = logprobs.topk(k_max, dim=-1, sorted=True)
    return torch.cat([chosen, values.double(), ids.double()], dim=1)


def unpack_logprobs(
    flat: list[float], top_k: list[int], vocab_size: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """`pack_logprobs`' tensor read back as a flat list: the chosen logprobs and each row's
    top_k[i] alternatives, best first."""
    k_max = max(min(max(top_k, default=0), vocab_size), 0)
    width = 1 + 2 * k_max
    chosen: list[float] = []
    top: list[list[tuple[int, float]]] = []
    for r, k in enumerate(top_k):
        row = flat[r * width : (r + 1) * width]
        chosen.append(row[0])
        top.append([(int(row[1 + k_max + j]), row[1 + j]) for j in range(min(k, k_max))])
    return chosen, top


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_k: list[int]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The chosen tokens' logprobs and each row's top_k[i] alternatives, best first (one transfer)."""
    packed = pack_logprobs(logprobs, token_ids, top_k)
    return unpack_logprobs(packed.view(-1).tolist(), top_k, logprobs.shape[1])
