"""Sampling parameters of one request: the fields, their coercion from JSON and their validation.

`SamplingParams` crosses processes (pickled inside `TokenizedGenerateReq`); `from_dict` parses a
request's `sampling_params` object and `verify` names the first invalid field in its ValueError,
which the server turns into a 400.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# The fields that constrain the output through a grammar backend; at most one may be set.
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")

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

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the token history (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

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
        for kind in GRAMMAR_KINDS:
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


_DECIMAL = re.compile(r"-?[0-9]+")


def token_id_key(key: Any) -> int:
    """A logit_bias key as a token id: an int, or its decimal digits as a string. Python's `int()`
    alone would also take " 7 ", "1_0" and non-ASCII digits, which no tokenizer writes."""
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    raise ValueError(f"not a token id: {key!r}")


def _as_logit_bias(name: str, value: Any) -> dict[int, float] | None:
    """{"50256": -100} as JSON sends it (string keys) or {50256: -100}."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _type_error(name, "an object mapping token ids to numbers", value)
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token_id = token_id_key(key)
        except ValueError:
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
