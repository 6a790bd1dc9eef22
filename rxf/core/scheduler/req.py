"""A request as the scheduler sees it: token ids, its KV handle and finish state (all host-side)."""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rxf.core.ipc.messages import FinishReason, PreparedRequest, RequestOptions
from rxf.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from rxf.core.grammar import GrammarMatcher
    from rxf.core.kvcache.kv_manager import KVHandle
    from rxf.core.kvcache.radix_cache import TokenKey
    from rxf.core.speculative.draft import DraftKV
    from rxf.core.speculative.eagle import EagleState
    from rxf.core.speculative.ngram import NgramIndex


@dataclass(eq=False)
class Req:
    """Region map of the request's tokens `fill_ids = prompt + output`, then `inflight` more:

    - `[0, cached_len)`: KV held by the radix tree (locked through `kv`);
    - `[cached_len, kv_len)`: KV in slots the request owns (computed, or being computed by a step
      in flight);
    - `[kv_len, seq_len)`: no KV yet: the uncomputed prompt part, the newest token, and the
      `inflight` tokens a launched step samples whose values the host does not know yet.
    Invariant when a step is scheduled: kv_len <= len(fill_ids), i.e. every token with KV is known
    on the host; only tokens without KV may be in flight (overlap scheduling, one step deep).
    """

    # What the request asks for, as the front door prepared and validated it: the scheduler
    # trusts it (prompt within the context and the KV pool, params verified) and never changes it.
    prepared: PreparedRequest
    # Position in the order the scheduler received requests (the same on every tensor-parallel rank):
    # ties in the ordering go by it, never by time or object identity.
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    # Tokens sampled by launched steps that the host has not read yet (0, 1, or 2 between a launch
    # and the previous step's postprocessing).
    inflight: int = 0
    kv: KVHandle | None = None  # the KV reservation (see kv_manager); None while it holds no KV
    # True once the whole prompt is scheduled and its last step samples a token: its next forward
    # is a decode of its newest token. False while waiting or between prefill chunks.
    decoding: bool = False
    # Tokens matched in the tree when the request was first admitted (reported as cached_tokens).
    cached_tokens: int | None = None
    finished_reason: FinishReason | None = None
    to_abort: bool = False
    generator: torch.Generator | None = None  # created by the runner, on its device, at the first draw
    # Streaming state: how many output ids were already sent, decode steps since the last send.
    sent_len: int = 0
    steps_since_send: int = 0
    # Logprobs not yet sent.
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: dict[str, Any] | None = None
    input_logprobs_sent: bool = False
    # Structured output: the compile in flight (the request waits until it is done), then the
    # matcher, which has accepted exactly `output_ids[grammar_start:]` (kept across retraction,
    # like the output). `grammar_start` is None until the output ends with
    # `sampling_params.grammar_after` (0 when that is empty): the matcher sleeps until then.
    grammar_future: Future[Any] | None = None
    grammar: GrammarMatcher | None = None
    grammar_start: int | None = None
    # Speculative decoding: the n-gram index of its tokens (built at its first drafted step), its
    # draft model's KV, and its decode forwards while speculation was on (`meta_info["spec_verify_ct"]`).
    ngram: NgramIndex | None = None
    draft_kv: DraftKV | None = None  # its KV in the draft model's pool (method "draft")
    eagle: EagleState | None = None  # where its EAGLE-3 head's next draft starts (method "eagle3")
    spec_verify_ct: int = 0

    @property
    def grammar_active(self) -> bool:
        return self.grammar is not None and self.grammar_start is not None
    # An embedding model's pooling so far (float32 [hidden], host): the sum of the computed
    # tokens' states for mean pooling, else the last computed token's state.
    pooled: torch.Tensor | None = None
    embedding: bytes | None = None  # the finished pooling, as `TokenOut.embedding` carries it
    # Timestamps (time.perf_counter(): CLOCK_MONOTONIC on Linux, one clock for every process of the
    # host, so the server's metrics compare them with their own): queued here, first admitted
    # (retractions do not move it), first token sampled. Sent with the finishing output.
    queued_at: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    first_token_at: float | None = None

    @property
    def rid(self) -> str:
        return self.prepared.rid

    @property
    def origin_input_ids(self) -> list[int]:
        """The prompt (media pad ids in place)."""
        return self.prepared.input_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.prepared.sampling_params

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """`sampling_params.stop_token_ids` for the per-step membership test (up to
        `RequestLimits.max_stop_token_ids` of them)."""
        return frozenset(self.sampling_params.stop_token_ids)

    @property
    def options(self) -> RequestOptions:
        return self.prepared.options

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """`fill_ids[start:end]` (0 <= start <= end), without building fill_ids."""
        prompt, n = self.origin_input_ids, len(self.origin_input_ids)
        return prompt[start:end] + self.output_ids[max(start - n, 0) : max(end - n, 0)]

    def tree_key(self, n: int) -> list[TokenKey]:
        """The radix-tree key of the first n tokens of `fill_ids`. A salted request's first token
        becomes (salt, token), which equals no plain token id and no other salt's: salted prefixes
        live in a subtree of their own, so requests share KV only with the same salt. Position i of
        an image or video is (its hash, i): its pad ids are ordinary vocabulary ids, which a text
        prompt could spell and another item's could share, but these keys equal no token id and
        no other item's (a hostile-input audit had a text prompt read an image's KV, and two images
        share a prefix)."""
        key: list[TokenKey] = list(self.fill_ids[:n])
        for item in self.prepared.mm_items or ():
            for i in range(min(item.length, max(n - item.offset, 0))):
                key[item.offset + i] = (item.hash, i)
        salt = self.options.cache_salt
        if salt is not None and key:
            key[0] = (salt, key[0])
        return key

    @property
    def known_len(self) -> int:
        """Tokens whose values the host knows: prompt + output so far."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def seq_len(self) -> int:
        """Tokens of the sequence, counting those still in flight."""
        return self.known_len + self.inflight

    @property
    def generated(self) -> int:
        """Output tokens, counting those still in flight."""
        return len(self.output_ids) + self.inflight

    @property
    def kv_len(self) -> int:
        return self.kv.length if self.kv is not None else 0

    @property
    def cached_len(self) -> int:
        return self.kv.cached if self.kv is not None else 0

    @property
    def owned_slots(self) -> int:
        return self.kv_len - self.cached_len

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - self.generated, 0)

    def chunk_len(self, start: int, n: int) -> int:
        """The length of a prefill chunk [start, start + n) moved so that it ends outside every
        bidirectional multimodal item: before an item it would cut (when the chunk starts before
        it), else at the item's end (a chunk may then exceed the chunk size by up to one item)."""
        for item in self.prepared.mm_items or ():
            lo, hi = item.offset, item.offset + item.length
            if item.bidirectional and lo < start + n < hi:
                return lo - start if lo > start else hi - start
        return n

    def wants_prompt_logprobs(self) -> bool:
        o = self.options
        return o.return_logprob and o.logprob_start_len >= 0 and self.input_logprobs is None

    def prompt_logits_from(self) -> int:
        """First absolute position whose logits prompt logprobs need (scores position + 1)."""
        return max(self.options.logprob_start_len, 1) - 1
