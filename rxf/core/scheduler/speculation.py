"""Speculative decoding in the scheduler: which decoding requests get drafts, and how many.

Proposers: "ngram" (`speculative/ngram.py`, per request on the host), "draft" (a smaller model
run ahead of the target, `speculative/draft.py`, batched over the step's requests) and "eagle3"
(an EAGLE-3 head fed the target's hidden states, `speculative/eagle.py`).

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

Trees (EAGLE-3 with `tree_topk` > 1, `speculative/eagle_tree.py`): a request's drafts come with
their parents; its slots are taken for every node, the verify walks the samples down the tree
(`accept.accepted_path`), and the kept nodes' slots move to the path's positions before the rest
are freed (`KVManager.keep_path`). Chains instead where a prefill chunk may join the step (an
extend cannot express a tree's mask) and for a request under a grammar (its masks follow one path).

Overlap: a step with drafts is always postprocessed before the next step is planned (the next
drafts come from its accepted tokens), so speculative steps run without overlap; steps above
`speculative.max_batch_size` decoding requests overlap as before.

EAGLE-3: every step's postprocessing is bracketed by `open_step` and `close_step`, between which
the head absorbs the target's states of the positions the step kept (`Eagle3Drafter.absorb`):
those of every request still running at `close_step`, and those of a request that finishes
meanwhile at its `release` (before its KV goes to the tree), all in one forward of the head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from rxf.core.config import SpeculativeConfig
from rxf.core.kvcache.kv_manager import KVManager
from rxf.core.runner.step_io import StepBatch, StepResult
from rxf.core.scheduler.constrained import ConstrainedDecoding
from rxf.core.scheduler.req import Req
from rxf.core.speculative.accept import first_chain
from rxf.core.speculative.draft import DraftModel
from rxf.core.speculative.eagle import AbsorbItem, Eagle3Drafter
from rxf.core.speculative.ngram import NgramIndex

logger = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafts accepted (the bonus or correction token is not counted)
    verify_steps: int = 0  # forwards in which some request had drafts


@dataclass
class _StepStates:
    """The target's auxiliary hidden states of the step being postprocessed, and where each of its
    requests' tokens start among their rows."""

    batch: StepBatch
    states: torch.Tensor
    first_row: dict[int, tuple[int, int]]  # id(req) -> (request index, first row)
    items: list[AbsorbItem]
    # id(req) -> the rows (after its first) of the positions a tree verify kept, root to leaf
    kept: dict[int, list[int]] = field(default_factory=dict)


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, grammar: ConstrainedDecoding, max_context_len: int,
        draft: DraftModel | Eagle3Drafter | None = None, kv: KVManager | None = None,
    ) -> None:
        kind = {"draft": DraftModel, "eagle3": Eagle3Drafter}.get(config.method)
        if (kind is None) != (draft is None) or (kind is not None and not isinstance(draft, kind)):
            raise ValueError(f"speculative.method {config.method!r}: the drafter given does not fit it")
        if isinstance(draft, Eagle3Drafter) and kv is None:
            raise ValueError("an EAGLE-3 drafter needs the KV manager (its absorbs write stale row entries too)")
        self.config = config
        self.grammar = grammar
        self.max_context_len = max_context_len
        self.draft = draft
        self.kv = kv
        self.counters = SpecCounters()
        self._step: _StepStates | None = None

    def applies(self, num_decoding: int) -> bool:
        """Whether a decode step of this many requests speculates."""
        return 0 < num_decoding <= self.config.max_batch_size

    def propose(self, reqs: list[Req], trees: bool = True) -> tuple[list[list[int]], list[list[int] | None]]:
        """Each request's draft tokens for its next decode step (possibly none) and, for a tree
        (EAGLE-3 with tree_topk > 1, where `trees`), their parents (None: a chain). A request
        under a grammar drafts a chain (the tree's first children), cut before the first draft the
        grammar rejects."""
        budgets = [self._budget(r) for r in reqs]
        parents: list[list[int] | None] = [None] * len(reqs)
        if isinstance(self.draft, Eagle3Drafter) and self.config.tree_topk > 1 and trees:
            drafts, parents = self.draft.propose_trees(reqs, budgets, self.config.tree_topk, self.config.tree_depth)
        elif self.draft is not None:
            drafts = self.draft.propose(reqs, budgets)
        else:
            drafts = [self._ngram(r, b) if b > 0 else [] for r, b in zip(reqs, budgets, strict=True)]
        for i, r in enumerate(reqs):
            if drafts[i] and r.grammar_active:
                if parents[i] is not None:
                    drafts[i], parents[i] = first_chain(drafts[i], parents[i]), None
                drafts[i] = drafts[i][: self.grammar.valid_prefix(r, drafts[i])]
        return drafts, parents

    def kept_rows(self, req: Req, rows: list[int]) -> None:
        """A tree verify kept the positions of these rows of the request's (its first: 0): the
        head absorbs the target's states of those rows."""
        if self._step is not None:
            self._step.kept[id(req)] = rows

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
        """The request gives up its KV (finish, abort, retraction): so does its draft's. Called
        before the KV is released: a request finishing in the step being postprocessed first has
        that step's positions absorbed (they may enter the tree)."""
        step = self._step
        if step is not None and id(req) in step.first_row:
            item = self._absorb_item(step, req, *step.first_row.pop(id(req)), keep=False)
            if item is not None:
                step.items.append(item)
        if self.draft is not None:
            self.draft.release(req)

    # ---- EAGLE-3: the head absorbs each step's target states ----
    def open_step(self, batch: StepBatch, result: StepResult) -> None:
        """Before the step's samples are accepted."""
        if not isinstance(self.draft, Eagle3Drafter) or result.aux_hidden is None:
            return
        first_row, row = {}, 0
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            if not req.finished and req.kv is not None:  # (one that ended while the step ran is gone)
                first_row[id(req)] = (i, row)
            row += n
        self._step = _StepStates(batch, result.aux_hidden, first_row, [])

    def close_step(self) -> None:
        """After the step's samples are accepted: absorb the positions it kept."""
        step, self._step = self._step, None
        if step is None:
            return
        assert isinstance(self.draft, Eagle3Drafter)
        for i, row in step.first_row.values():
            item = self._absorb_item(step, step.batch.reqs[i], i, row, keep=True)
            if item is not None:
                step.items.append(item)
        self.draft.absorb(step.items, step.states)

    def _absorb_item(self, step: _StepStates, req: Req, i: int, row: int, keep: bool) -> AbsorbItem | None:
        """Request i's positions of the step whose KV it kept and whose next token is known
        (`row`: the first of its tokens' rows in the step's states)."""
        assert self.kv is not None
        if req.kv is None:
            return None
        batch = step.batch
        start = batch.prefix_lens[i]
        end = min(start + batch.extend_lens[i], req.known_len - 1, req.kv_len)
        if end <= start:
            return None
        kept = step.kept.get(id(req))
        state_rows = torch.arange(row, row + end - start) if kept is None else torch.tensor(kept[: end - start]) + row
        return AbsorbItem(
            req=req if keep else None,
            row=req.kv.row,
            start=start,
            tokens=req.tokens(start + 1, end + 1),
            slots=req.kv.slots(end)[start:].clone(),
            state_rows=state_rows,
            row_write=self.kv.stale_entries(req, start),
        )

    def record(self, drafted: int, accepted: int) -> None:
        self.counters.drafted_tokens += drafted
        self.counters.accepted_tokens += accepted
