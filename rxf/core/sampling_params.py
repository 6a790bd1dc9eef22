"""Sampling parameters of one request: the fields, their coercion from JSON and their validation.

`SamplingParams` crosses processes inside the `PreparedRequest`; `from_dict` parses a request's
`sampling_params` object and verifies it, naming the first invalid field in its ValueError (the
server's 400). Every front door reaches these rules through `RequestPreparer.prepare` only.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from rxf.core.echo import echo

# The fields that constrain the output through a grammar backend; at most one may be set.
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")

# Counts are 32-bit: beyond that no context holds them (the context rule, `fit_max_new_tokens`,
# refuses far less), and the scheduler's int tensors stay in range.
MAX_COUNT = 2**31 - 1
# max_new_tokens of a native request (`/generate`, `Runtime`) that does not give one (SGLang's).
DEFAULT_MAX_NEW_TOKENS = 128
# Seeds are 64-bit; choice i of an n-choice request samples with (seed + i) mod SEED_SPACE.
SEED_SPACE = 2**64


@dataclass(frozen=True)
class Bound:
    """A closed range, open at an end where `low_open` / `high_open` (`(0, 1]`)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def json_schema(self) -> dict[str, float]:
        return {
            "exclusiveMinimum" if self.low_open else "minimum": self.low,
            "exclusiveMaximum" if self.high_open else "maximum": self.high,
        }

    def __str__(self) -> str:
        high = "2**64" if self.high == SEED_SPACE else self.high
        return f"{'(' if self.low_open else '['}{self.low}, {high}{')' if self.high_open else ']'}"


# The range of every numeric field, the one place they are checked (both front doors and the
# Python API verify through here, with the same meaning: the OpenAI routes add no bound of their
# own) and documented (`json_schema`). SGLang's native bounds where it has them; where it has none,
# bounds that keep float32 sampling finite: a temperature or a repetition penalty that rounds to
# inf or 0 in float32 turns a row's probabilities into NaN.
NUMERIC_BOUNDS: dict[str, Bound] = {
    "max_new_tokens": Bound(0, MAX_COUNT),
    "min_new_tokens": Bound(0, MAX_COUNT),  # and at most max_new_tokens
    # Not OpenAI's [0, 2]: vLLM's and SGLang's OpenAI servers only refuse a negative temperature, so
    # a client of theirs may send 2.5, and it means the same here on every route.
    "temperature": Bound(0, 100),
    "top_p": Bound(0, 1, low_open=True),
    "top_k": Bound(-1, MAX_COUNT),  # -1 or 0: off; beyond the vocabulary: all of it
    "min_p": Bound(0, 1),
    "repetition_penalty": Bound(0.01, 2),  # float32 logits / 1e-300 would be inf
    "frequency_penalty": Bound(-2, 2),
    "presence_penalty": Bound(-2, 2),
    "seed": Bound(0, SEED_SPACE, high_open=True),
}
LOGIT_BIAS_BOUND = Bound(-100, 100)
# The longest token sequence a constraint may wait for (an end-of-reasoning marker is one to a few).
MAX_GRAMMAR_AFTER = 32


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
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
    # The constraint starts once the output ends with these token ids (a thinking model's end of
    # reasoning, `</think>`); what comes before them, and they, are free. Empty: from the first token.
    grammar_after: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, vocab_size: int | None = None) -> SamplingParams:
        """Parses a request's `sampling_params` object (already JSON-decoded), then verifies it."""
        kwargs: dict[str, Any] = {}
        for name, value in (d or {}).items():
            coerce = _COERCERS.get(name)
            if coerce is None:
                raise ValueError(f"sampling_params: unknown field {name!r}")
            kwargs[name] = coerce(name, value)
        params = cls(**kwargs)
        params.verify(vocab_size)
        return params

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n-choice request: with a seed, it samples with
        (seed + index) mod 2**64 (choice 0 keeps the caller's seed), so choice i of a seeded call is
        the same through every front door, and every choice's seed stays in range."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % SEED_SPACE)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the token history (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def verify(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first invalid field. Comparisons are written so NaN fails."""
        for name, bound in NUMERIC_BOUNDS.items():
            value = getattr(self, name)
            if value is not None:
                _require(bound.contains(value), name, f"must be in {bound}", value)
        min_ok = self.min_new_tokens <= self.max_new_tokens
        _require(min_ok, "min_new_tokens", f"must not exceed the output budget ({self.max_new_tokens})",
                 self.min_new_tokens)
        for token_id in self.stop_token_ids:
            in_vocab = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
            bound = "vocab_size" if vocab_size is None else vocab_size
            _require(in_vocab, "stop_token_ids", f"ids must be in [0, {bound})", token_id)
        for stop in self.stop:
            _require(stop != "", "stop", "stop strings must be non-empty", stop)
        for token_id, bias in (self.logit_bias or {}).items():
            in_vocab = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
            bound = "vocab_size" if vocab_size is None else vocab_size
            _require(in_vocab, "logit_bias", f"token ids must be in [0, {bound})", token_id)
            _require(LOGIT_BIAS_BOUND.contains(bias), "logit_bias", f"values must be in {LOGIT_BIAS_BOUND}", bias)
        constraints = [name for name in ("regex", "json_schema", "ebnf") if getattr(self, name) is not None]
        _require(len(constraints) <= 1, constraints[-1] if constraints else "regex",
                 "at most one of regex, json_schema and ebnf may be set", constraints)
        if self.grammar_after:
            _require(bool(constraints), "grammar_after", "needs a constraint (regex, json_schema or ebnf)",
                     self.grammar_after)
            _require(len(self.grammar_after) <= MAX_GRAMMAR_AFTER, "grammar_after",
                     f"takes at most {MAX_GRAMMAR_AFTER} token ids", len(self.grammar_after))
            for token_id in self.grammar_after:
                in_vocab = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
                _require(in_vocab, "grammar_after", f"ids must be in [0, {vocab_size or 'vocab_size'})", token_id)

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
        raise ValueError(f"sampling_params.{name}: {reason}, got {echo(value)}")


def _type_error(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"sampling_params.{name}: expected {expected}, got {echo(value)}")


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
    raise ValueError(f"not a token id: {echo(key)}")


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

# The JSON Schema of each annotation, for the API document (`json_schema`), beside its coercer.
_JSON_TYPE_BY_TYPE: dict[str, dict[str, Any]] = {
    "int": {"type": "integer"},
    "int | None": {"type": ["integer", "null"]},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "list[str]": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "list[int]": {"type": "array", "items": {"type": "integer"}},
    "dict[int, float] | None": {
        "type": ["object", "null"],
        "propertyNames": {"pattern": _DECIMAL.pattern.join("^$")},
        "additionalProperties": {"type": "number", **LOGIT_BIAS_BOUND.json_schema()},
    },
    "str | None": {"type": ["string", "null"]},
}


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a `sampling_params` object as `from_dict` takes it: each field's type and
    range (unknown fields are refused). Integers are JSON integers: `1.0` is refused."""
    properties = {}
    for f in fields(SamplingParams):
        schema = dict(_JSON_TYPE_BY_TYPE[str(f.type)])
        bound = NUMERIC_BOUNDS.get(f.name)
        if bound is not None:
            schema |= bound.json_schema()
        properties[f.name] = schema
    return {"type": "object", "properties": properties, "additionalProperties": False}


def fit_max_new_tokens(requested: int | None, default: int | None, prompt_len: int, context_len: int,
                       param: str) -> int:
    """The completion budget of a prompt of `prompt_len` tokens: the one rule of both front doors.

    A budget the client gave (`requested`) must fit the context next to the prompt, else
    ValueError naming `param`: vLLM's OpenAI server and SGLang's /generate both refuse it (SGLang
    unless --allow-auto-truncate), and a silent cut would hide the client's mistake. None (not
    given) takes `default` (None: the whole remaining context), cut to what fits."""
    room = context_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ValueError(
            f"{param}: {echo(requested)} new tokens do not fit next to the prompt's {prompt_len} tokens in the "
            f"model's context length {context_len} (at most {room} new tokens fit)"
        )
    return requested
