"""Typed messages that cross process boundaries (ZMQ ipc sockets, msgpack through `codec`).

Flow: TokenizerManager --`ToScheduler`--> Scheduler --`ToDetokenizer`--> Detokenizer, and
Detokenizer / Scheduler --`ToTokenizer`--> TokenizerManager. Each union is what one kind of socket
receives: its members are tagged structs (the tag is the class name), so a receiver decodes the
bytes straight into the right type and refuses anything else. Fields are plain data (and CPU
tensors inside `MultimodalItem.data`, carried by the codec's tensor extension); the nested request
types `SamplingParams` and `RequestOptions` are dataclasses, which msgspec encodes by field.

The per-step outputs (`TokenOut` and what holds it) are `gc=False` structs: hundreds are decoded
per step, and the garbage collector need not track objects that can hold no reference cycle (they
hold only ids, strings, numbers and lists of them); measured in benchmarks/RESULTS.md.

Admin requests carry a `req_id` their reply repeats: the TokenizerManager matches replies by it,
so replies may come in any order and a reply nobody waits for any more is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from rxf.core.sampling_params import SamplingParams


class MultimodalItem(msgspec.Struct, array_like=True):
    """One image or video of a request, preprocessed and hashed in the TokenizerManager.

    Its tokens are `input_ids[offset : offset + length]`: pad ids derived from `hash`, so the radix
    cache matches a repeated item like repeated text; the model replaces their embeddings with the
    item's `length` feature rows, computed from `data` (CPU tensors: pixel_values, image_sizes, ...).
    """

    modality: str  # "image" or "video"
    hash: int  # 64-bit digest of the preprocessed inputs (the vision-feature cache key)
    offset: int
    length: int
    data: dict[str, Any] = {}
    # Its tokens attend to each other both ways (Gemma 3 images): a prefill chunk never ends inside it
    # (`Req.chunk_len`), so the model computes its attention with the whole item present.
    bidirectional: bool = False


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
    # Embedding requests only: keep the first `dimensions` values (Matryoshka truncation; None:
    # all), then L2-normalise when `normalize` says so (None: as the model's pooling config says).
    dimensions: int | None = None
    normalize: bool | None = None


class PreparedRequest(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A request as the front door validated it (`RequestPreparer.prepare`, the one place): the
    engine trusts it and never changes it. Invariants: 0 < len(input_ids) < the context length and
    len(input_ids) < the KV pool; every id in [0, vocab_size); `sampling_params` verified, its
    max_new_tokens fitted next to the prompt; `options` in range; a constraint, if any, compiled.
    A copy with other fields: `msgspec.structs.replace`."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    options: RequestOptions = msgspec.field(default_factory=RequestOptions)
    # Images / videos in prompt order (None: a text-only request).
    mm_items: list[MultimodalItem] | None = None


class AbortReq(msgspec.Struct, tag=True, array_like=True):
    rid: str


class FlushCacheReq(msgspec.Struct, tag=True, array_like=True):
    """Empty the prefix cache (answered with an `AdminReply` of the same `req_id`)."""

    req_id: int


class ProfileReq(msgspec.Struct, tag=True, array_like=True):
    """Start (`start`) or stop a step profile (`rxf/core/runner/step_profiler.py`; answered with an
    `AdminReply` of the same `req_id`). A start names the profile's folder under
    `runtime.profile_dir`, the steps after which it stops itself (None: until stopped) and whether
    torch.profiler traces the kernels."""

    req_id: int
    start: bool
    name: str = ""
    num_steps: int | None = None
    kernels: bool = False


class GetStatsReq(msgspec.Struct, tag=True, array_like=True):
    """Ask the scheduler for its counters (answered with a `StatsReply` of the same `req_id`)."""

    req_id: int


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


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    req_id: int
    stats: SchedulerStats


class StatsSnapshot(msgspec.Struct, tag=True, array_like=True):
    """Sent unasked by each replica's rank 0 after its steps (at most every `STATS_INTERVAL_S` while
    busy, and at once when it goes idle), so that monitoring reads the latest figures without
    waiting for a step to end."""

    dp_rank: int
    stats: SchedulerStats


# Seconds between two stats snapshots of a busy scheduler.
STATS_INTERVAL_S = 0.1


@dataclass
class AdminResult:
    """The outcome of an admin request that changes the engine (a flush, a profile)."""

    ok: bool
    message: str = ""


class AdminReply(msgspec.Struct, tag=True, array_like=True):
    req_id: int
    result: AdminResult


# The message of an abort that was asked for (the client left, /abort_request, a shutdown's drain), as
# opposed to one that reports a failure (an internal error, a request the scheduler cannot run).
ABORT_REQUESTED = "aborted"


class FinishReason(msgspec.Struct, array_like=True, gc=False):
    """Why a request ended. type: "stop" (EOS, a stop token or a stop string), "length" or "abort"
    (`message` says why: ABORT_REQUESTED, or the failure; `status`: 400 when the request's own input
    caused the failure, e.g. a grammar that no output can satisfy, else None, an internal error)."""

    type: str
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None
    status: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


class TokenOut(msgspec.Struct, array_like=True, gc=False):
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
    stop: list[str] = []
    no_stop_trim: bool = False
    # Logprobs, aligned with new_token_ids; top lists hold (token_id, logprob) pairs.
    output_token_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt logprobs, sent once with the first output: entry j is for prompt position
    # logprob_start_len + j (the first prompt token has none: it gets None).
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_token_ids: list[int] | None = None
    # An embedding model's result, sent with the finished output: the pooled vector, truncated and
    # normalised as the request asked, as float32 little-endian bytes.
    embedding: bytes | None = None
    # On the finishing output only: the request's scheduler times (time.perf_counter()), queued,
    # first scheduled, first token, finished; the middle two None when it never got that far.
    timings: list[float | None] | None = None
    # Speculative decoding: the request's decode forwards so far (0 without speculation).
    spec_verify_ct: int = 0


class BatchTokenOut(msgspec.Struct, tag=True, array_like=True, gc=False):
    outs: list[TokenOut]


class StrOut(msgspec.Struct, array_like=True, gc=False):
    """TokenOut plus the text it adds. `text_delta` never ends in half a multi-byte character and,
    while unfinished, holds back any tail that could still become a stop string."""

    token: TokenOut
    text_delta: str


class BatchStrOut(msgspec.Struct, tag=True, array_like=True, gc=False):
    outs: list[StrOut]


class RankBroadcast(msgspec.Struct, tag=True, array_like=True):
    """What a replica's rank 0 passes to its other tensor-parallel ranks at each loop iteration:
    the messages it received, as received (every rank decodes them itself), or `stop` when it
    stops."""

    frames: list[memoryview] = []
    stop: bool = False


# What each kind of socket receives (the codec decodes into exactly these).
ToScheduler = PreparedRequest | AbortReq | FlushCacheReq | GetStatsReq | ProfileReq
ToDetokenizer = BatchTokenOut
ToTokenizer = BatchStrOut | StatsSnapshot | StatsReply | AdminReply
