"""OpenAI request fields -> the engine's native request, with the checks only OpenAI makes.

Every other rule (ranges, the context, the constraint's validity, ...) is the engine's, checked
once for every front door when the native request is prepared (`rxf.core.frontend.request_preparer`);
`prepare_request` runs that now, so a bad value is a 400 before a stream starts, and states its error in
the OpenAI request's field names. Every check raises `APIError(400, ..., param=<the OpenAI field>)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from rxf.core.echo import echo
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import GenerateRequest, RequestError
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.sampling_params import GRAMMAR_KINDS, SamplingParams, token_id_key
from rxf.entrypoints.chat.prompt import response_format_constraint
from rxf.entrypoints.choices import check_n
from rxf.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from rxf.entrypoints.server_state import APIError, engine_api_error

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
    """The checks completions and chat share (the engine checks the ranges when it prepares)."""
    for name in _UNSUPPORTED_FIELDS:
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported; use regex, ebnf, json_schema or response_format", name)
    if req.lora_path is not None:
        raise bad_request("LoRA adapters are not supported", "lora_path")
    try:
        check_n(req.n)
    except ValueError as exc:
        raise bad_request(str(exc), "n") from None
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (server-side ranking is not supported)", "best_of")


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")


def slow_to_plan(req: GenerationFields) -> bool:
    """Whether planning `req` compiles an output constraint (seconds for a large schema, and the
    first also builds the backend's tables): work for a thread, whatever the body's size. (A
    forced tool choice compiles one too: the chat route adds it.)"""
    return any(getattr(req, name) is not None for name in _CONSTRAINT_FIELDS) or (
        getattr(req, "response_format", None) is not None and req.response_format.type != "text"
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


def native_params(req: GenerationFields, max_tokens: int | None, extra_stop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The native `sampling_params` dict. Fields the client left out are left out (max_tokens
    None: the route's default budget applies), so the engine's own defaults apply to them."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop += [s for s in extra_stop if s not in stop]
    params: dict[str, Any] = {
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
        "max_new_tokens": max_tokens,
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


def native_names(prompt: Mapping[str, str], max_tokens: str, top_logprobs: str, constraint: str | None) -> dict[str, str]:
    """The OpenAI field of each native field an engine error may name: `prompt` for the prompt's
    fields, `max_tokens` (the field the budget came from), `top_logprobs` (the field the count of
    alternatives came from) and `constraint` (the field that set the output constraint)."""
    names = {f"sampling_params.{f.name}": f.name for f in fields(SamplingParams)}
    names |= {"sampling_params.max_new_tokens": max_tokens, "sampling_params.min_new_tokens": "min_tokens"}
    if constraint is not None:
        names |= {f"sampling_params.{kind}": constraint for kind in GRAMMAR_KINDS}
    return names | {"top_logprobs_num": top_logprobs} | dict(prompt)


def prepare_request(preparer: RequestPreparer, req: GenerateRequest, names: Mapping[str, str]) -> PreparedRequest:
    """The engine's one preparation of `req`, its errors as 400s naming the OpenAI field (`names`,
    from `native_names`). Blocking: run it off the event loop."""
    try:
        return preparer.prepare(req)
    except RequestError as exc:
        error = engine_api_error(exc.renamed(names))
        assert error is not None  # a RequestError is always a 400
        raise error from None
