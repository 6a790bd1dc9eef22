"""Speculative decoding in the scheduler: which decoding requests get drafts, and how many.

Proposers: "ngram" (`speculative/ngram.py`, per request on the host) and "draft" (a smaller model
run ahead of the target, `speculative/draft.py`, batched over the step's requests).

Drafts are planned with the decode rows (`Scheduler._plan_decode`): each request's newest token
plus its drafts become an extend over its cached prefix, with a slot for every drafted token taken
before the step is launched, so admission counts them as used. Drafts take free slots only: they
never evict the radix cache or retract a request (a pool too full for them decodes plainly).
After the step (`Scheduler._accept`) the accepted tokens go through the usual stop checks one by
one, and the slots of rejected tokens, and of tokens after a stop, go straight back to the free
list (`KVManager.truncate`); only accepted tokens ever reach the radix cache.

A request gets no drafts when its newest token is still in flight (overlap: the scheduler
resolves the previous step first whenever it may speculate), when its grammar is asleep
(`grammar_after`: the drafts might wake it), or when its budget (max_new_tokens, the context) has
room for only one more token. A grammar truncates the drafts before the first one it rejects.

Overlap: a step with drafts is always postprocessed before the next step is planned (the next
drafts come from its accepted tokens), so speculative steps run without overlap; steps above
`speculative.max_batch_size` decoding requests overlap as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rxf.core.config import SpeculativeConfig
from rxf.core.scheduler.constrained import ConstrainedDecoding
from rxf.core.scheduler.req import Req
from rxf.core.speculative.draft import DraftModel
from rxf.core.speculative.ngram import NgramIndex

logger = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafts accepted (the bonus or correction token is not counted)
    verify_steps: int = 0  # forwards in which some request had drafts


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, grammar: ConstrainedDecoding, max_context_len: int,
        draft: DraftModel | None = None,
    ) -> None:
        if (config.method == "draft") != (draft is not None):
            raise ValueError("speculative.method 'draft' needs the draft model's runner (and only it)")
        self.config = config
        self.grammar = grammar
        self.max_context_len = max_context_len
        self.draft = draft
        self.counters = SpecCounters()

    def applies(self, num_decoding: int) -> bool:
        """Whether a decode step of this many requests speculates."""
        return 0 < num_decoding <= self.config.max_batch_size

    def propose(self, reqs: list[Req]) -> list[list[int]]:
        """Each request's draft tokens for its next decode step (possibly none)."""
        budgets = [self._budget(r) for r in reqs]
        if self.draft is not None:
            drafts = self.draft.propose(reqs, budgets)
        else:
            drafts = [self._ngram(r, b) if b > 0 else [] for r, b in zip(reqs, budgets, strict=True)]
        return [
            d[: self.grammar.valid_prefix(r, d)] if d and r.grammar_active else d
            for r, d in zip(reqs, drafts, strict=True)
        ]

    def _budget(self, req: Req) -> int:
        if req.inflight or (req.grammar is not None and not req.grammar_active):
            return 0
        p = req.sampling_params
        # The step emits up to len(drafts) + 1 tokens and extends len(drafts) + 1 positions.
        return min(self.config.num_draft_tokens, p.max_new_tokens - req.generated - 1, self.max_context_len - req.seq_len)

    def _ngram(self, req: Req, budget: int) -> list[int]:
        if req.ngram is None:
            req.ngram = NgramIndex(self.config.ngram_min_match, self.config.ngram_max_match)
        req.ngram.sync(req.origin_input_ids, req.output_ids)
        return req.ngram.propose(budget)

    def release(self, req: Req) -> None:
        """The request gives up its KV (finish, abort, retraction): so does its draft's."""
        if self.draft is not None:
            self.draft.release(req)

    def record(self, drafted: int, accepted: int) -> None:
        self.counters.drafted_tokens += drafted
        self.counters.accepted_tokens += accepted
