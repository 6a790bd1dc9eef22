"""Sampling parameters and the batched sampler run once per scheduler step.

`SamplingParams` crosses processes (pickled inside `TokenizedGenerateReq`); `SamplingBatch` is built by
the scheduler each step from its running requests and turns the model's last-position logits into
next tokens without any device-to-host synchronisation: its host-to-device copies are non-blocking
(from pageable memory they are staged before the call returns) and nothing is read back. The caller
reads the step's results in one transfer (`rxf.core.scheduler.output.sample_next`).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from rxf.core.penalties import Penalties

logger = logging.getLogger(__name__)

# Temperatures below this are raised to it before dividing, so logits / T stays finite in float32.
# At that scale the distribution is already a point mass except between near-exact ties.
_MIN_TEMPERATURE = 1e-5
_MAX_SEED = 2**64


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # OpenAI logit_bias: token id -> value in [-100, 100] added to its logit (after penalties).
    logit_bias: dict[int, float] | None = None
    # Structured output (at most one): a regular expression, a JSON schema given as JSON text
    # (`{"type": "object"}` for any JSON object), or an EBNF grammar. The grammar backend
    # (`rxf_register_grammar_backends`) compiles it; the sampler masks tokens it does not allow.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Parses a request's `sampling_params` object (already JSON-decoded), then verifies it."""
        kwargs: dict[str, Any] = {}
        for name, value in (d or {}).items():
            coerce = _COERCERS.get(name)
            if coerce is None:
                raise ValueError(f"sampling_params: unknown field {name!r}")
            kwargs[name] = coerce(name, value)
        params = cls(**kwargs)
        params.verify()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first invalid field. Comparisons are written so NaN fails."""
        _require(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", self.max_new_tokens)
        min_ok = 0 <= self.min_new_tokens <= self.max_new_tokens
        _require(min_ok, "min_new_tokens", "must be in [0, max_new_tokens]", self.min_new_tokens)
        _require(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(self.top_k >= -1, "top_k", "must be -1 or 0 (off) or a positive integer", self.top_k)
        _require(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _require(self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(-2 <= value <= 2, name, "must be in [-2, 2]", value)
        for token_id in self.stop_token_ids:
            in_vocab = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
            bound = "vocab_size" if vocab_size is None else vocab_size
            _require(in_vocab, "stop_token_ids", f"ids must be in [0, {bound})", token_id)
        for stop in self.stop:
            _require(stop != "", "stop", "stop strings must be non-empty", stop)
        if self.seed is not None:
            _require(0 <= self.seed < _MAX_SEED, "seed", "must be in [0, 2**64)", self.seed)
        for token_id, bias in (self.logit_bias or {}).items():
            in_vocab = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
            bound = "vocab_size" if vocab_size is None else vocab_size
            _require(in_vocab, "logit_bias", f"token ids must be in [0, {bound})", token_id)
            _require(-100 <= bias <= 100, "logit_bias", "values must be in [-100, 100]", bias)
        constraints = [name for name in ("regex", "json_schema", "ebnf") if getattr(self, name) is not None]
        _require(len(constraints) <= 1, constraints[-1] if constraints else "regex",
                 "at most one of regex, json_schema and ebnf may be set", constraints)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The constraint as (kind, text), kind in {"regex", "json_schema", "ebnf"}; None if unconstrained."""
        for kind in ("regex", "json_schema", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None


def _require(ok: bool, name: str, reason: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{name}: {reason}, got {value!r}")


def _type_error(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"sampling_params.{name}: expected {expected}, got {value!r}")


def _as_int(name: str, value: Any) -> int:
    # bool is an Integral in Python; a JSON `true` for a count is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _type_error(name, "an integer", value)
    return int(value)


def _as_optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _as_int(name, value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _type_error(name, "a finite number", value)
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _as_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise _type_error(name, "a string or a list of strings", value)
    return list(value)


def _as_optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def _as_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise _type_error(name, "a list of integers", value)
    return [_as_int(name, v) for v in value]


def _as_logit_bias(name: str, value: Any) -> dict[int, float] | None:
    """{"50256": -100} as JSON sends it (string keys) or {50256: -100}."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _type_error(name, "an object mapping token ids to numbers", value)
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise _type_error(name, "token ids as keys", key) from None
        out[token_id] = _as_float(name, bias)
    return out


# Keyed by the fields' annotation strings (annotations are postponed): a field of a new type fails at
# import rather than going unchecked.
_COERCER_BY_TYPE: dict[str, Callable[[str, Any], Any]] = {
    "int": _as_int,
    "int | None": _as_optional_int,
    "float": _as_float,
    "bool": _as_bool,
    "list[str]": _as_str_list,
    "list[int]": _as_int_list,
    "dict[int, float] | None": _as_logit_bias,
    "str | None": _as_optional_str,
}
_COERCERS = {f.name: _COERCER_BY_TYPE[str(f.type)] for f in fields(SamplingParams)}


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
    """The step's token bitmask for the constrained rows (structured output).

    `bitmask` is already on the logits' device; `apply(logits, bitmask, rows)` sets the disallowed
    logits of `rows` to -inf in place (the grammar backend's kernel); other rows are untouched.
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
            return SampleOutput(penalized.argmax(dim=-1), raw)
        probs = self._filter(torch.softmax(penalized / self.temperatures, dim=-1))
        next_ids = self._draw(probs)
        if self.greedy is not None:
            next_ids = torch.where(self.greedy, penalized.argmax(dim=-1), next_ids)
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
            # top_p. The top token (mass before it 0) always stays; top_p = inf keeps everything.
            drop |= (cumulative - sorted_probs) >= self.top_ps * cumulative[:, -1:]
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
