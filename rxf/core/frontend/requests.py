"""What a generation request is before it is prepared: the native request every front door
builds (`GenerateRequest`), the per-request bounds, and the errors requests end with (each maps to
one HTTP status), plus the lookup of the checkpoint's multimodal processor that preprocesses its
images. `rxf.core.frontend.request_preparer` turns a `GenerateRequest` into the engine's `PreparedRequest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rxf.core.echo import echo
from rxf.core.ipc.messages import RequestOptions
from rxf.core.sampling_params import DEFAULT_MAX_NEW_TOKENS, GRAMMAR_KINDS, SamplingParams
from rxf.core.tokenizer_info import max_token_chars

if TYPE_CHECKING:
    from rxf.core.config import EngineConfig

# OpenAI's bound on top logprobs per token, applied to native requests too.
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_LEN = 256
# A request id travels in every streamed chunk's meta_info: a long one would multiply the output.
MAX_RID_LEN = 256
# Request priorities are 32-bit signed integers (lower runs first): room for any tiering scheme,
# while a value beyond it is a client bug, refused rather than silently honoured.
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class RequestError(ValueError):
    """The request is invalid (HTTP 400). The message reads "field: reason" when one field is at
    fault, the field named as the native request names it (`sampling_params.temperature`,
    `image_data[0]`)."""

    def renamed(self, names: Mapping[str, str]) -> RequestError:
        """The same error in another front door's terms: a field of `names` heading the message
        becomes its name there (`{"sampling_params.max_new_tokens": "max_tokens"}`; an index
        stays: `image_data[0]` -> `messages: image[0]` for `{"image_data": "messages: image"}`)."""
        message = str(self)
        head, sep, reason = message.partition(": ")
        base, bracket, index = head.partition("[")
        if not sep or base not in names:
            return self
        return RequestError(f"{names[base]}{bracket}{index}: {reason}")


class EngineDeadError(RuntimeError):
    """A child process died; in-flight and new requests fail with this (HTTP 503)."""


class OverloadedError(RuntimeError):
    """As many requests are in flight as the server may hold; retry later (HTTP 503 + Retry-After)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past `server.request_timeout_s` and was aborted (HTTP 504)."""


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds enforced before anything reaches the scheduler (None: unbounded)."""

    max_in_flight: int | None = None
    timeout_s: float | None = None
    max_stop_strings: int = 16
    max_logit_bias: int = 300
    # Room for every special token of today's vocabularies (Llama 3 reserves 256); a million of them
    # cost each step of every request a list scan (found by the hostile-input audit, 2026-12-07).
    max_stop_token_ids: int = 1024
    # scheduler.policy == "priority"; otherwise only priority 0 is accepted, as vLLM does, so a
    # client never believes a priority is honoured when it is not.
    priority_scheduling: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> RequestLimits:
        return cls(
            max_in_flight=(config.scheduler.max_running_requests + config.scheduler.max_queued_requests)
            * config.parallel.dp_size,
            timeout_s=config.server.request_timeout_s,
            max_stop_strings=config.server.max_stop_strings,
            max_logit_bias=config.server.max_logit_bias,
            max_stop_token_ids=config.server.max_stop_token_ids,
            priority_scheduling=config.scheduler.policy == "priority",
        )

    def check_params(self, params: SamplingParams) -> None:
        """Raises ValueError naming the field (`sampling_params.<name>: ...`) when over a bound."""
        if len(params.stop) > self.max_stop_strings:
            raise ValueError(
                f"sampling_params.stop: at most {self.max_stop_strings} stop strings, got {len(params.stop)}"
            )
        n_bias = len(params.logit_bias or {})
        if n_bias > self.max_logit_bias:
            raise ValueError(f"sampling_params.logit_bias: at most {self.max_logit_bias} entries, got {n_bias}")
        n_stop_ids = len(params.stop_token_ids)
        if n_stop_ids > self.max_stop_token_ids:
            raise ValueError(
                f"sampling_params.stop_token_ids: at most {self.max_stop_token_ids} ids, got {n_stop_ids}"
            )

    def check_priority(self, priority: Any) -> None:
        """Raises RequestError naming `priority` unless it is an integer in PRIORITY_RANGE that the
        configured policy honours."""
        lo, hi = PRIORITY_RANGE
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority: expected an integer, got {type(priority).__name__}")
        if not lo <= priority <= hi:
            raise RequestError(f"priority: must be in [{lo}, {hi}], got {echo(priority)}")
        if priority != 0 and not self.priority_scheduling:
            raise RequestError(
                f"priority: got {echo(priority)}, but priority scheduling is off (scheduler.policy is not "
                "'priority'); send 0 or leave it out"
            )


# Texts longer than this are tokenized off the event loop (about a millisecond of tokenizing).
LONG_TEXT_CHARS = 8192


def check_prompt_chars(text: str, tokenizer: Any, max_context_len: int, param: str) -> None:
    """Refuse, before tokenizing it, a text too long for any tokenization of it to fit the context:
    tokenizing megabytes takes seconds of the event loop, which every other client waits for."""
    limit = max_context_len * max_token_chars(tokenizer)
    if len(text) > limit:
        raise RequestError(
            f"{param}: {len(text)} characters cannot fit the model's context of {max_context_len} tokens "
            f"(at most {limit} characters)"
        )


@dataclass
class GenerateRequest:
    """One native generation request as a front door received it (a batch is a list of these), not
    validated yet: `RequestPreparer.prepare` checks it and turns it into a `PreparedRequest`."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | SamplingParams | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    rid: str | None = None  # None: a fresh one
    # Images / videos for the prompt's placeholder tokens, in order (see rxf.plugins.multimodal.media,
    # .video for the accepted forms).
    image_data: Any = None
    video_data: Any = None
    # Whether tokenizing `text` adds the tokenizer's special tokens (BOS); a rendered chat template
    # writes its own.
    add_special_tokens: bool = True
    # The budget when `sampling_params` gives no max_new_tokens (None: the whole remaining context);
    # cut to what fits next to the prompt (`fit_max_new_tokens`).
    default_max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    # An embedding request: the prompt's pooled hidden states, nothing generated (an embedding
    # model serves only these, a generative model none; `sampling_params` must be left out).
    embed: bool = False

    def slow_to_prepare(self) -> bool:
        """Media to decode, an output constraint to compile (the first one also builds the grammar
        backend's tokenizer tables) or a long text to tokenize (the tokenizer releases the GIL
        meanwhile): work that must not hold the server's event loop."""
        if self.image_data or self.video_data:
            return True
        if isinstance(self.text, str) and len(self.text) > LONG_TEXT_CHARS:
            return True
        params = self.sampling_params
        if isinstance(params, SamplingParams):
            return params.grammar is not None
        return isinstance(params, dict) and any(params.get(kind) is not None for kind in GRAMMAR_KINDS)


def load_multimodal_processor(config: EngineConfig, engine_info: dict[str, Any], registry: Any = None) -> Any:
    """The registered processor for the checkpoint's architecture, or None for a text-only model."""
    from transformers import AutoConfig

    from rxf.core.registry import PluginRegistry

    registry = registry or PluginRegistry.load(config.plugins.allow, config.plugins.deny)
    model_path, vocab_size = engine_info["model_path"], engine_info["vocab_size"]
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    for arch in hf_config.architectures or []:
        factory = registry.multimodal_processor(arch)
        if factory is not None:
            return factory(model_path, config.multimodal, vocab_size)
    return None
