"""What crosses between the scheduler and the model runner each step: plain host data.

The step is schedule -> run -> postprocess. The scheduler plans a `StepBatch` (requests, token counts,
slots, token ids; never a device tensor) and hands it to `StepRunner.launch`, which builds the device
tensors, runs the forward and samples, and returns at once; `StepRunner.resolve` then waits for the
step and gives a `StepResult` read from the device in one copy. Between the two the host may plan
and launch the next step (overlap scheduling): a token the previous step samples is then not known on
the host yet, and the batch names it by `prev_rows` instead; the runner takes it from that step's
sampled ids on the device.

`StepRunner` is all the scheduler needs from a runner, so the scheduler can be tested with a fake
one (`rxf.testing.fake_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rxf.core.draft_tree import draft_path
from rxf.core.forward import ForwardMode
from rxf.core.runner.sampling import GrammarMask

if TYPE_CHECKING:
    from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
    from rxf.core.pooling import Pooling
    from rxf.core.scheduler.req import Req

# An input token that the previous step samples: its value reaches the forward on the device.
PENDING = -1


@dataclass
class StepBatch:
    """One forward as the scheduler plans it. Request i computes its tokens
    [prefix_lens[i], prefix_lens[i] + extend_lens[i]) into slots `out_cache_loc` (flattened in order);
    its row's entries before prefix_lens[i] are already on the device except `row_writes[i]`
    = (start, slots) for positions [start, prefix_lens[i]).

    Sampled rows: the requests with `sample[i]`, in order, each from the logits of its last token;
    `StepResult.next_ids[j]` is sampled row j's token. Other requests (chunks of a prompt) sample
    nothing. `prev_rows[i] >= 0`: request i's last input token is the previous step's sampled row
    `prev_rows[i]` (its `input_ids` entry is PENDING).

    Speculative decoding: `drafts[i]` are the draft tokens among request i's new tokens (its last
    len(drafts[i])); a sampled request with drafts has one sampled row per position of its newest
    token and of each draft, in order (`num_samples`), position t sampled as if `drafts[i][:t]` were
    already output. `banned_ids` and `grammar` then have one row per sampled row too.
    """

    mode: ForwardMode  # PREFILL / EXTEND / DECODE / MIXED (extend rows and decode rows together)
    reqs: list[Req]  # the runner reads only their immutable fields (params, prompt, media, seed)
    rows: list[int]  # each request's req_to_token row
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    prev_rows: list[int]
    out_cache_loc: torch.Tensor  # CPU int64 [sum(extend_lens)]
    row_writes: list[tuple[int, torch.Tensor] | None]
    sample: list[bool]
    # Per request: the first absolute position whose logits its prompt logprobs need, or None.
    prompt_logits_from: list[int | None]
    banned_ids: list[list[int]]  # per sampled row: ids that may not be drawn yet (min_new_tokens)
    # Structured output: one bitmask row per sampled row, on the host (the runner moves it).
    grammar: GrammarMask | None = None
    drafts: list[list[int]] | None = None  # per request (None: no request has drafts)
    # Per request: its drafts' parents for a tree (`rxf.core.speculative.accept`), None for a chain
    # (None: every request's drafts are a chain). Position t of a tree samples after draft t - 1's path.
    draft_parents: list[list[int] | None] | None = None

    @property
    def sampled(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sample, strict=True) if s]

    def num_samples(self, i: int) -> int:
        """Sampled rows of request i: 0, 1, or 1 + its drafts."""
        return (1 + len(self.drafts[i]) if self.drafts else 1) if self.sample[i] else 0

    def draft_of(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts else []

    def ahead(self, i: int, t: int) -> list[int]:
        """The drafts request i's sampled position t follows (as if already output)."""
        parents = self.draft_parents[i] if self.draft_parents else None
        return self.draft_of(i)[:t] if parents is None else draft_path(self.draft_of(i), parents, t - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class StepResult:
    """A step's outcome on the host. Lists are per sampled row; dicts are keyed by request index."""

    next_ids: list[int] = field(default_factory=list)  # per sampled row (StepBatch.num_samples)
    # (chosen token's logprob, [(token id, logprob)] top alternatives) for rows that asked.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)
    prompt_logprobs: dict[int, dict[str, Any]] = field(default_factory=dict)
    # An embedding model's step: row i is request i's part of its embedding (float32, on the host;
    # see `StepExecutor._pool`). Nothing is sampled.
    pooled: torch.Tensor | None = None
    row_errors: dict[int, BaseException] = field(default_factory=dict)  # per request: its sampling failed
    error: BaseException | None = None  # the whole step failed (its KV was not computed)
    # EAGLE-3: the target's auxiliary hidden states of every token the step computed (rows in the
    # batch's token order). The one device tensor here: it feeds the draft head and never reaches
    # the host.
    aux_hidden: torch.Tensor | None = None


class StepRunner(Protocol):
    """What the scheduler needs from a model runner."""

    device: torch.device  # where the runner computes (the scheduler only reads its type)
    vocab_size: int
    max_context_len: int
    max_total_tokens: int
    eos_token_ids: list[int]
    pooling: Pooling | None  # an embedding model's pooling (None: a generative model)
    req_to_token_pool: ReqToTokenPool  # the scheduler uses only their host-side free lists
    token_to_kv_pool: TokenToKVPool

    def launch(self, batch: StepBatch) -> Any:
        """Start the step; returns a handle for `resolve`. Never raises for a failing forward: the
        failure is reported by `resolve`."""

    def resolve(self, handle: Any) -> StepResult:
        """Wait for a launched step (in launch order) and read its results."""
