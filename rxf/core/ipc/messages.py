"""Typed messages that cross process boundaries (over ZMQ ipc sockets, pickled).

Only these dataclasses travel between rxf's own processes; the network never sends pickles.
Flow: TokenizerManager --PreparedRequest/AbortReq/...--> Scheduler --BatchTokenOut-->
Detokenizer --BatchStrOut--> TokenizerManager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rxf.core.sampling_params import SamplingParams


@dataclass
class MultimodalItem:
    """One image or video of a request, preprocessed and hashed in the TokenizerManager.

    Its tokens are `input_ids[offset : offset + length]`: pad ids derived from `hash`, so the radix
    cache matches a repeated item like repeated text; the model replaces their embeddings with the
    item's `length` feature rows, computed from `data` (CPU tensors: pixel_values, image_sizes, ...).
    """

    modality: str  # "image" or "video"
    hash: int  # 64-bit digest of the preprocessed inputs (the vision-feature cache key)
    offset: int
    length: int
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks for besides its prompt and sampling parameters: declared here only, and
    carried whole by the front door's `GenerateRequest`, the `PreparedRequest` and the scheduler's
    `Req` (which holds its prepared request)."""

    stream: bool = False
    return_logprob: bool = False
    # Prompt logprobs are returned for prompt positions >= logprob_start_len; -1 means none.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # Tenant isolation: requests share cached prefixes only with requests of the same salt.
    cache_salt: str | None = None
    # Under scheduler.policy = "priority": lower values are admitted first and retracted last.
    priority: int = 0


@dataclass(frozen=True)
class PreparedRequest:
    """A request as the front door validated it (`RequestPreparer.prepare`, the one place): the
    engine trusts it and never changes it. Invariants: 0 < len(input_ids) < the context length and
    len(input_ids) < the KV pool; every id in [0, vocab_size); `sampling_params` verified, its
    max_new_tokens fitted next to the prompt; `options` in range; a constraint, if any, compiled.
    Plain fields only, so that a codec other than pickle can carry it."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    # Images / videos in prompt order (None: a text-only request).
    mm_items: list[MultimodalItem] | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetStatsReq:
    """Ask the scheduler for its counters (answered with a `SchedulerStats`)."""


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    total_slots: int
    free_slots: int
    tree_slots: int
    evictable_slots: int
    cache_hit_rate: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StatsSnapshot:
    """Sent unasked by each replica's rank 0 after its steps (at most every `STATS_INTERVAL_S` while
    busy, and at once when it goes idle), so that monitoring reads the latest figures without
    waiting for a step to end."""

    dp_rank: int
    stats: SchedulerStats


# Seconds between two stats snapshots of a busy scheduler.
STATS_INTERVAL_S = 0.1


@dataclass
class FlushCacheResult:
    ok: bool
    message: str = ""


# The message of an abort that was asked for (the client left, /abort_request, a shutdown's drain), as
# opposed to one that reports a failure (an internal error, a request the scheduler cannot run).
ABORT_REQUESTED = "aborted"


@dataclass
class FinishReason:
    """Why a request ended. type: "stop" (EOS, a stop token or a stop string), "length" or "abort"
    (`message` says why: ABORT_REQUESTED, or the failure)."""

    type: str
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclass
class TokenOut:
    """One request's news from one scheduler step (sent every `stream_interval` decode steps,
    right after prefill, and when the request finishes)."""

    rid: str
    new_token_ids: list[int]
    finished: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Detokenization settings of the request (small; sent each time so the detokenizer keeps no
    # request registry of its own).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    # Logprobs, aligned with new_token_ids; top lists hold (token_id, logprob) pairs.
    output_token_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt logprobs, sent once with the first output: entry j is for prompt position
    # logprob_start_len + j (the first prompt token has none: it gets None).
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_token_ids: list[int] | None = None


@dataclass
class BatchTokenOut:
    outs: list[TokenOut]


@dataclass
class StrOut:
    """TokenOut plus the text it adds. `text_delta` never ends in half a multi-byte character and,
    while unfinished, holds back any tail that could still become a stop string."""

    token: TokenOut
    text_delta: str


@dataclass
class BatchStrOut:
    outs: list[StrOut]
