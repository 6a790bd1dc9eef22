"""OpenAI request fields -> the engine's native sampling parameters, with the checks OpenAI makes.

Every check raises `APIError(400, ..., param=<the OpenAI field>)`. The engine verifies the native
parameters again; `verify_native` runs that verification up front so a bad value is a 400 before
a stream starts, and translates the native field name in its message back to the OpenAI one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rxf.core.echo import echo
from rxf.core.sampling_params import SamplingParams, fit_max_new_tokens, token_id_key
from rxf.core.tokenizer_manager import MAX_CACHE_SALT_LEN, MAX_TOP_LOGPROBS, RequestLimits
from rxf.entrypoints.chat import ChatInputError
from rxf.entrypoints.chat.prompt import check_constraint as check_native_constraint
from rxf.entrypoints.chat.prompt import response_format_constraint
from rxf.entrypoints.choices import MAX_N
from rxf.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from rxf.entrypoints.server_state import APIError

MAX_LOGPROBS = MAX_TOP_LOGPROBS
# Choice i of a seeded request uses seed + i, so seeds stay below 2**63 and the sum below the
# engine's 2**64 bound.
_MAX_SEED = 2**63

# Request field -> the native constraint it sets (at most one per request).
_CONSTRAINT_FIELDS = {
    "regex": "regex",
    "ebnf": "ebnf",
    "json_schema": "json_schema",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
}
_UNSUPPORTED_FIELDS = ("structural_tag", "guided_choice")
# Native names that differ from the OpenAI field they come from.
_OPENAI_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_NATIVE_FIELD = re.compile(r"sampling_params\.(\w+)")


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            404,
            f"the model {echo(requested)} does not exist; this server serves {served!r}",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        )


def check_common(req: GenerationFields) -> None:
    """The checks completions and chat share (the engine checks the remaining ranges)."""
    for name in _UNSUPPORTED_FIELDS:
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported; use regex, ebnf, json_schema or response_format", name)
    if req.lora_path is not None:
        raise bad_request("LoRA adapters are not supported", "lora_path")
    if not 0 <= req.temperature <= 2:
        raise bad_request(f"temperature must be in [0, 2], got {echo(req.temperature)}", "temperature")
    if not 0 < req.top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {echo(req.top_p)}", "top_p")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {echo(req.n)}", "n")
    if req.seed is not None and not 0 <= req.seed < _MAX_SEED:
        raise bad_request(f"seed must be in [0, 2**63), got {echo(req.seed)}", "seed")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_CACHE_SALT_LEN:
        raise bad_request(f"cache_salt must be 1 to {MAX_CACHE_SALT_LEN} characters", "cache_salt")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (server-side ranking is not supported)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {echo(req.logprobs)}", "logprobs")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {echo(req.top_logprobs)}", "top_logprobs"
            )


def output_constraint(req: GenerationFields) -> tuple[str, dict[str, str]]:
    """The request's output constraint as (the field that set it, native params): ("", {}) for
    none. Two constraints at once are a 400 naming the second."""
    found: list[tuple[str, str, str]] = []  # (field, native kind, text)
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        found += [("response_format", kind, text) for kind, text in
                  response_format_constraint(response_format.model_dump(by_alias=True)).items()]
    for name, kind in _CONSTRAINT_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, kind, value if isinstance(value, str) else json.dumps(value)))
    if not found:
        return "", {}
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise bad_request(f"at most one output constraint may be set; got {first} and {second}", second)
    name, kind, text = found[0]
    return name, {kind: text}


def check_constraint(grammar: Any, params: dict[str, Any], param: str | None) -> None:
    """`rxf.entrypoints.chat.prompt.check_constraint` as a 400 naming the OpenAI field `param`
    before any stream starts. Blocking: run it off the event loop."""
    try:
        check_native_constraint(grammar, params, param)
    except ChatInputError as exc:
        raise bad_request(str(exc), exc.param) from None


def max_new_tokens(
    requested: int | None,
    param: str,
    default: int | None,
    prompt_len: int,
    context_len: int,
    prompt_param: str,
) -> int:
    """The completion budget by the engine's rule (`fit_max_new_tokens`), as 400s naming `param`
    (or `prompt_param` for a prompt that fills the context alone)."""
    if prompt_len >= context_len:
        raise bad_request(
            f"the prompt has {prompt_len} tokens; the model's context length is {context_len}", prompt_param
        )
    if requested is not None and requested < 0:
        raise bad_request(f"{param} must be >= 0, got {echo(requested)}", param)
    try:
        return fit_max_new_tokens(requested, default, prompt_len, context_len, param)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def native_params(req: GenerationFields, max_tokens: int, extra_stop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The native `sampling_params` dict. Extension fields the client left out are left out, so the
    engine's own defaults apply to them."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop += [s for s in extra_stop if s not in stop]
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "min_new_tokens": req.min_tokens,
    }
    if stop:
        params["stop"] = stop
    optional = {
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "stop_token_ids": req.stop_token_ids,
    }
    params |= {key: value for key, value in optional.items() if value is not None}
    if req.logit_bias:
        params["logit_bias"] = _logit_bias(req.logit_bias)
    return params


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            out[token_id_key(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {echo(key)}", "logit_bias") from None
    return out


def check_priority(req: GenerationFields, limits: RequestLimits | None) -> None:
    """The engine's priority check (range, and nonzero only under the priority policy), as a 400."""
    try:
        (limits or RequestLimits()).check_priority(req.priority)
    except ValueError as exc:
        raise bad_request(str(exc), "priority") from None


def verify_native(params: dict[str, Any], vocab_size: int, limits: RequestLimits | None = None) -> None:
    """The engine's own verification, run now so that it answers 400 before any stream starts."""
    try:
        native = SamplingParams.from_dict(params)
        native.verify(vocab_size)
        (limits or RequestLimits()).check_params(native)
    except ValueError as exc:
        message = str(exc)
        match = _NATIVE_FIELD.search(message)
        if match is None:
            raise bad_request(message, None) from None
        param = _OPENAI_NAME.get(match.group(1), match.group(1))
        raise bad_request(message.replace(match.group(0), param), param) from None
