"""The scheduler: one `step()` = schedule -> run -> postprocess.

- schedule (`_schedule`): plain bookkeeping. Pick the batch (unfinished prefill chunks and newly
  admitted requests, with the decoding requests in the same forward when mixed chunked prefill is
  on; else a DECODE of the running requests), reserve its KV (`KVManager`) and describe it as a
  `StepBatch`: requests, token counts, slots, token ids. No device tensor is touched here.
- run: `runner.launch(batch)`; the runner builds the tensors, runs the forward and samples.
- postprocess (`_postprocess`): `runner.resolve` gives the sampled ids and logprobs on the host;
  append them, check stop conditions, cache prefixes, build the outputs.

Overlap (`runner.overlap`): step N is scheduled and launched before step N-1 is postprocessed, so
the host's work runs while the device computes. A request in step N-1 then enters step N with its
newest token unknown (`Req.inflight`); the runner feeds it from step N-1's sampled ids on the
device. If step N-1 ends the request (EOS, a stop string), its row in step N is discarded when step
N is postprocessed and its KV was released already. A request whose length will end it is not
scheduled again. Steps that sample for constrained or penalised requests are resolved before the
next one is planned, since their next mask or penalty needs the token. Every decision depends only
on the request stream and the sampled tokens, so tensor-parallel ranks stay in lockstep.

Speculative decoding (`speculative.method`, `speculation.py`): a decode row may carry draft tokens;
the runner samples each drafted position and `_accept` takes the tokens the drafts agree with,
checking the stop conditions after each one, so the output ends exactly where decoding without
drafts would. While a step may speculate, the step in flight is postprocessed before it is planned.

Faults: a forward that raises fails the requests of its batch; an exception in one request's own
processing (its sampling, prompt logprobs or stop check) fails that request only. Either way the
failed requests end with an "abort" carrying the error and their KV is released at once, and the
scheduler keeps serving the others. Anything else (a bookkeeping bug) propagates and ends the
process: its state could no longer be trusted.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rxf.core.config import EngineConfig, chunk_size
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import ABORT_REQUESTED, FinishReason, PreparedRequest, SchedulerStats, TokenOut
from rxf.core.kvcache.kv_manager import KVManager
from rxf.core.kvcache.radix_cache import RadixCache
from rxf.core.runner.distributed import tp_size
from rxf.core.runner.step_io import PENDING, StepBatch, StepResult, StepRunner
from rxf.core.scheduler.admission import admit
from rxf.core.scheduler.constrained import ConstrainedDecoding
from rxf.core.scheduler.output import StopChecker, make_token_out
from rxf.core.scheduler.policy import order_waiting
from rxf.core.scheduler.req import Req
from rxf.core.scheduler.speculation import Speculator
from rxf.core.speculative.accept import accepted_path, accepted_tokens, row_depths
from rxf.core.speculative.draft import DraftModel
from rxf.core.speculative.eagle import Eagle3Drafter

logger = logging.getLogger(__name__)


@dataclass
class _Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    retractions: int = 0
    last_log_time: float = 0.0
    last_log_tokens: int = 0


@dataclass
class _Planned:
    """A batch being built: per request its new tokens, and whether it samples."""

    reqs: list[Req] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    prev_rows: list[int] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    row_writes: list[tuple[int, torch.Tensor] | None] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    prompt_logits_from: list[int | None] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_parents: list[list[int] | None] = field(default_factory=list)  # per request: a tree's, None for a chain
    decode_rows: int = 0
    extend_rows: int = 0


@dataclass
class _Launched:
    batch: StepBatch
    handle: Any
    decode: list[bool]  # per request: a decode row (its streamed token need not go out at once)


class Scheduler:
    def __init__(
        self, config: EngineConfig, runner: StepRunner, tokenizer, check_memory: bool = False,
        draft: DraftModel | Eagle3Drafter | None = None,
    ) -> None:
        self.config = config
        self.sc = config.scheduler
        self.runner = runner
        self.chunk_size = chunk_size(self.sc, runner.device.type)
        self.pooling = runner.pooling  # an embedding model: prompts are pooled, nothing is sampled
        # Mean pooling needs every prompt token's state, and a cached prefix's are not computed, so
        # it runs without the prefix cache; last-token pooling keeps it (a cached prefix's KV is what
        # computing it would give, and the last token is always computed: `KVManager._match`).
        mean_pooling = self.pooling is not None and self.pooling.method == "mean"
        self.tree = RadixCache(runner.token_to_kv_pool, disable=config.cache.disable_radix_cache or mean_pooling)
        pair_keys = draft is not None and draft.pairs_tree_keys  # an EAGLE-3 head's KV shares the slots
        self.kv = KVManager(runner.req_to_token_pool, runner.token_to_kv_pool, self.tree, pair_keys)
        eos = set(runner.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.stop = StopChecker(tokenizer, sorted(eos), runner.max_context_len)
        self.grammar = ConstrainedDecoding.create(config, tokenizer, runner.vocab_size, self.stop)
        spec = config.speculative
        self.spec = None if spec.method == "none" else Speculator(spec, self.grammar, runner.max_context_len, draft, self.kv)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # requests holding KV (decoding, or between prefill chunks)
        self.new_token_ratio = self.sc.init_new_token_ratio
        self.rng = random.Random(config.runtime.seed)
        self.check_memory = check_memory
        self.counters = _Counters(last_log_time=time.perf_counter())
        self._arrivals = itertools.count()
        self._inflight: _Launched | None = None  # launched, not yet postprocessed (overlap)

    # ---- requests in ----
    def add_request(self, prepared: PreparedRequest) -> None:
        """Queue a request. It was validated at the front door (`RequestPreparer`): it fits the
        context and the KV pool, so it can always run."""
        req = Req(prepared, arrival=next(self._arrivals))
        self.grammar.submit(req)
        self.waiting.append(req)

    def abort(self, rid: str) -> list[TokenOut]:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = FinishReason("abort", message=ABORT_REQUESTED)
                return [make_token_out(req, finished=True)]
        for req in self.running:
            if req.rid == rid:
                req.to_abort = True  # released at the start of the next step
        return []

    def flush_cache(self) -> tuple[bool, str]:
        if self.has_work:
            n = len(self.running) + len(self.waiting)
            return False, f"cannot flush the cache while {n} requests are in flight"
        self.kv.clear()
        return True, "cache flushed"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    # ---- one step ----
    def step(self) -> list[TokenOut]:
        outs: list[TokenOut] = []
        if self._inflight is not None and (self._needs_tokens(self._inflight.batch) or self._may_speculate()):
            outs += self._postprocess(self._take_inflight())
        outs += self._release_aborted()
        outs += [make_token_out(r, finished=True) for r in self.grammar.resolve(self.waiting)]
        batch = self._schedule(outs)
        prev = self._take_inflight()
        if batch is not None:
            self._inflight = _Launched(batch[0], self.runner.launch(batch[0]), batch[1])
            self._after_launch(batch[0])
        if prev is not None:  # overlap: the device runs `batch` meanwhile
            outs += self._postprocess(prev)
        if self._inflight is not None and not self.runner.overlap:
            outs += self._postprocess(self._take_inflight())
        if batch is None and prev is None:  # only grammars still compiling (if anything)
            self.grammar.wait(self.waiting, timeout=0.01)
        if self.check_memory:
            self.kv.check(self.running + self.waiting)
        return outs

    def _take_inflight(self) -> _Launched | None:
        launched, self._inflight = self._inflight, None
        return launched

    @staticmethod
    def _needs_tokens(batch: StepBatch) -> bool:
        """Whether the next step must see this step's tokens before it is planned: a constrained
        request's next mask, or a penalised request's next penalty, reads them; the next drafts
        continue a speculative step's accepted tokens."""
        return batch.drafts is not None or any(
            r.grammar is not None or r.sampling_params.reads_history for r in batch.sampled
        )

    def _may_speculate(self) -> bool:
        """Whether the next decode step may draft (its requests' newest tokens are then needed)."""
        return self.spec is not None and self.spec.applies(sum(r.decoding for r in self.running))

    def _release_aborted(self) -> list[TokenOut]:
        aborted = [r for r in self.running if r.to_abort]
        return [self._finish(r, FinishReason("abort", message=ABORT_REQUESTED)) for r in aborted]

    # ---- schedule ----
    def _schedule(self, outs: list[TokenOut]) -> tuple[StepBatch, list[bool]] | None:
        """The next batch: prefill work (unfinished chunks first, then admissions), with the
        decoding requests in the same forward when mixed chunked prefill is on; else a decode.
        Returns it with, per request, whether it is a decode row."""
        plan = _Planned()
        decoding = [r for r in self.running if r.decoding and not self._ends_by_length(r)]
        if self.sc.mixed_chunked_prefill and decoding:
            # Tree drafts verify as decode rows only: where prefill work may join, the drafts are chains.
            prefill_waits = bool(self.waiting) or any(not r.decoding for r in self.running)
            self._plan_decode(plan, decoding, outs, trees=not prefill_waits)
        self._plan_chunks(plan)
        self._plan_admissions(plan)
        if not plan.reqs and decoding:  # no prefill work could run: decode alone
            self._plan_decode(plan, decoding, outs)
        if not plan.reqs:
            return None
        if plan.extend_rows:
            mode = ForwardMode.MIXED if plan.decode_rows else ForwardMode.EXTEND
        else:
            mode = ForwardMode.DECODE
        sampled = [r for r, s in zip(plan.reqs, plan.sample, strict=True) if s]
        drafts = [d for d, s in zip(plan.drafts, plan.sample, strict=True) if s] if any(plan.drafts) else None
        trees = plan.draft_parents if drafts and any(p is not None for p in plan.draft_parents) else None
        # The output index each sampled row would take (the min_new_tokens ban): its depth in the drafts.
        depths = [row_depths(p, len(d)) for d, p, s in zip(plan.drafts, plan.draft_parents, plan.sample, strict=True) if s]
        batch = StepBatch(
            mode=mode,
            reqs=plan.reqs,
            rows=plan.rows,
            prefix_lens=plan.prefix_lens,
            extend_lens=plan.extend_lens,
            input_ids=plan.input_ids,
            prev_rows=plan.prev_rows,
            out_cache_loc=torch.cat(plan.slots) if len(plan.slots) > 1 else plan.slots[0],
            row_writes=plan.row_writes,
            sample=plan.sample,
            prompt_logits_from=plan.prompt_logits_from,
            banned_ids=[self.stop.banned_ids(r, t) for r, ts in zip(sampled, depths, strict=True) for t in ts],
            grammar=self.grammar.mask(sampled, drafts),
            drafts=plan.drafts if drafts else None,
            draft_parents=trees,
        )
        return batch, [i < plan.decode_rows for i in range(len(plan.reqs))]

    def _admissible(self, req: Req) -> bool:
        return self.grammar.ready(req) and req.inflight == 0

    def _ends_by_length(self, req: Req) -> bool:
        """Whether the tokens in flight already end the request by length (no step needed)."""
        p = req.sampling_params
        return req.inflight > 0 and (req.generated >= p.max_new_tokens or req.seq_len >= self.runner.max_context_len)

    def _plan_decode(self, plan: _Planned, decoding: list[Req], outs: list[TokenOut], trees: bool = True) -> None:
        """One new token for each decoding request (and its drafts; `trees`: they may be a tree),
        retracting some if the KV runs out; a lone request that outgrew the whole cache ends here."""
        decoding = self._ensure_decode_space(decoding)
        drafts, parents = self._drafts(decoding, trees)
        slots = self.kv.alloc_slots(len(decoding) + sum(map(len, drafts)))
        if slots is None:
            outs.append(self._finish(decoding[0], FinishReason("length", message="the KV cache is full")))
            return
        prev = self._prev_rows()
        for req, draft, tree, slot in zip(decoding, drafts, parents, slots.split([1 + len(d) for d in drafts]),
                                          strict=True):
            kv_len = req.kv_len
            self.kv.grow_with(req, slot)
            row = prev.get(id(req), -1) if req.inflight else -1
            self._add_row(plan, req, kv_len, [req.output_ids[-1] if row < 0 else PENDING, *draft], row, draft, tree)
            plan.sample.append(True)
            plan.prompt_logits_from.append(None)
        plan.slots.append(slots)
        plan.decode_rows = len(decoding)

    def _drafts(self, decoding: list[Req], trees: bool) -> tuple[list[list[int]], list[list[int] | None]]:
        """Each decoding request's draft tokens (all [] when this step does not speculate) and, for
        a tree, their parents (None: a chain). Drafts take only free slots: they never evict cached
        prefixes or retract a request."""
        none: tuple[list[list[int]], list[list[int] | None]] = ([[] for _ in decoding], [None] * len(decoding))
        if self.spec is None or not self.spec.applies(len(decoding)):
            return none
        drafts, parents = self.spec.propose(decoding, trees)
        if len(decoding) + sum(map(len, drafts)) > self.kv.free_slots():
            return none
        return drafts, parents

    def _prev_rows(self) -> dict[int, int]:
        """Sampled-row index in the step in flight, per request (by id)."""
        if self._inflight is None:
            return {}
        return {id(r): j for j, r in enumerate(self._inflight.batch.sampled)}

    def _add_row(
        self, plan: _Planned, req: Req, prefix_len: int, ids: list[int], prev_row: int, drafts: list[int] | None = None,
        parents: list[int] | None = None,
    ) -> None:
        plan.reqs.append(req)
        plan.drafts.append(drafts or [])
        plan.draft_parents.append(parents)
        plan.rows.append(req.kv.row)
        plan.prefix_lens.append(prefix_len)
        plan.extend_lens.append(len(ids))
        plan.input_ids += ids
        plan.prev_rows.append(prev_row)
        plan.row_writes.append(self.kv.row_writes(req, prefix_len))

    def _prefill_budget(self, plan: _Planned) -> int:
        """Prompt tokens this step may still compute: the chunk size is the budget of one step, all
        prompts together (SGLang's chunked prefill), within max_prefill_tokens."""
        budget = min(self.chunk_size or self.sc.max_prefill_tokens, self.sc.max_prefill_tokens)
        return budget - sum(plan.extend_lens[plan.decode_rows :])

    def _plan_chunks(self, plan: _Planned) -> None:
        """The next chunks of the requests whose prompt (or jumped-forward text) is only partly
        computed, the nearest to done first, within the step's budget; they keep their row and lock.
        Finishing started prompts before the rest lets their first tokens out a step or more sooner
        than giving every prompt a chunk of each step (where none finishes until all do)."""
        # (A prompt whose last chunk is in flight without sampling, max_new_tokens 0, has none left.)
        started = [r for r in self.running if not r.decoding and r.kv_len < r.seq_len]
        for req in sorted(started, key=lambda r: r.seq_len - r.kv_len):
            left = self._prefill_budget(plan)
            if left <= 0:
                break
            n = req.chunk_len(req.kv_len, min(left, req.seq_len - req.kv_len))
            kv_len = req.kv_len
            slots = self.kv.grow(req, n)
            if slots is None:
                break
            self._add_extend(plan, req, kv_len, n, slots)

    def _plan_admissions(self, plan: _Planned) -> None:
        if not self.waiting or self.kv.free_rows() == 0:
            return
        ready = [r for r in self.waiting if self._admissible(r)]
        adm = admit(
            order_waiting(ready, self.sc.policy, self.kv, self.rng),
            self.running,
            self.kv,
            new_token_ratio=self.new_token_ratio,
            max_prefill_tokens=self._prefill_budget(plan),
            chunk_size=self.chunk_size,
            batch_nonempty=bool(plan.extend_rows),
        )
        for req, extend_len in zip(adm.reqs, adm.extend_lens, strict=True):
            self.waiting.remove(req)
            self.running.append(req)
            if req.cached_tokens is None:  # its first admission
                req.cached_tokens = req.cached_len
                req.scheduled_at = time.perf_counter()
                self.counters.prompt_tokens += len(req.origin_input_ids)
                self.counters.cached_tokens += req.cached_len
            kv_len = req.kv_len - extend_len
            self._add_extend(plan, req, kv_len, extend_len, req.kv.slots()[kv_len:].clone())

    def _add_extend(self, plan: _Planned, req: Req, kv_len: int, n: int, slots: torch.Tensor) -> None:
        self._add_row(plan, req, kv_len, req.fill_ids[kv_len : kv_len + n], -1)
        plan.slots.append(slots)
        completes = kv_len + n == req.seq_len
        plan.sample.append(completes and req.sampling_params.max_new_tokens > 0)
        plan.prompt_logits_from.append(req.prompt_logits_from() if req.wants_prompt_logprobs() else None)
        plan.extend_rows += 1

    def _after_launch(self, batch: StepBatch) -> None:
        for req, samples in zip(batch.reqs, batch.sample, strict=True):
            if samples:
                req.inflight += 1
                req.decoding = True  # its prompt is complete: its next forward decodes
        if batch.drafts is not None:
            assert self.spec is not None
            self.spec.counters.verify_steps += 1
        if batch.mode in (ForwardMode.DECODE, ForwardMode.MIXED):
            self.counters.decode_steps += 1
            self.new_token_ratio = max(self.new_token_ratio - self.sc.new_token_ratio_decay, self.sc.min_new_token_ratio)
            if self.counters.decode_steps % self.sc.log_interval == 0:
                self._log_stats()

    def _ensure_decode_space(self, decoding: list[Req]) -> list[Req]:
        """Retract requests until every remaining one gets a slot: the lowest priority first (the
        largest `priority` value; all are 0 unless the policy is "priority"), then the least
        progress, then the latest arrival.

        A retracted request keeps its output so far: its KV goes into the tree and it waits to be
        re-admitted, where its prefix (prompt + output) matches again, so no work is lost while
        the cache keeps it. The estimate of future tokens was too low, so the ratio jumps back up.
        """
        if self.kv.available() >= len(decoding):
            return decoding
        order = sorted(
            decoding, key=lambda r: (-r.options.priority, r.generated, -len(r.origin_input_ids), -r.arrival)
        )
        while self.kv.available() < len(decoding) and len(decoding) > 1:
            victim = order.pop(0)
            decoding.remove(victim)
            self.running.remove(victim)
            self.kv.release(victim)
            if self.spec is not None:
                self.spec.release(victim)
            self.waiting.insert(0, victim)
            self.counters.retractions += 1
            logger.info(
                "KV cache full: retracted request %s (priority %d) after %d tokens",
                victim.rid, victim.options.priority, victim.generated,
            )
        self.new_token_ratio = self.sc.init_new_token_ratio
        return decoding

    # ---- postprocess ----
    def _postprocess(self, launched: _Launched) -> list[TokenOut]:
        batch = launched.batch
        result = self.runner.resolve(launched.handle)
        for req, samples in zip(batch.reqs, batch.sample, strict=True):
            if samples:
                req.inflight -= 1
        if result.error is not None:
            return self._fail_step(batch, result.error)
        if self.spec is not None:
            self.spec.open_step(batch, result)
        outs: list[TokenOut] = []
        live = [i for i, r in enumerate(batch.reqs) if not r.finished and r.kv is not None]
        for i in live:
            self.kv.commit(batch.reqs[i], batch.prefix_lens[i] + batch.extend_lens[i])
        j = 0  # the request's first sampled row
        for i, req in enumerate(batch.reqs):
            first, j = j, j + batch.num_samples(i)
            if req.finished:
                continue  # ended (or aborted) while this step ran: its row is discarded
            if i in result.row_errors:
                outs.append(self._fail(req, result.row_errors[i]))
                continue
            if i in result.prompt_logprobs:
                req.input_logprobs = result.prompt_logprobs[i]
            # Whether this step computed the prompt's last token (with overlap, a later chunk may be
            # planned, growing kv_len, before this step is postprocessed).
            completes = batch.prefix_lens[i] + batch.extend_lens[i] == req.seq_len
            if result.pooled is not None:
                self._pool(req, result.pooled[i], completes)
            if not launched.decode[i] and req.kv is not None:
                self.kv.cache(req)  # share the computed prompt with other requests while it runs
            if batch.sample[i]:
                if self.spec is not None and launched.decode[i]:
                    req.spec_verify_ct += 1
                parents = batch.draft_parents[i] if batch.draft_parents else None
                outs += self._accept(req, result, first, batch.draft_of(i), parents, batch.prefix_lens[i],
                                     force_send=not launched.decode[i])
            elif completes and req.sampling_params.max_new_tokens == 0:
                outs.append(self._finish(req, FinishReason("length")))  # prefill only (or an embedding)
        if self.spec is not None:
            self.spec.close_step()
        return outs

    def _pool(self, req: Req, part: torch.Tensor, complete: bool) -> None:
        """Add a step's part of the request's embedding; `complete`: the step computed the rest of
        its prompt (an embedding request's budget is 0 tokens), so the embedding is done."""
        assert self.pooling is not None
        mean = self.pooling.method == "mean"
        req.pooled = part if req.pooled is None or not mean else req.pooled + part
        if complete:
            vector = req.pooled / len(req.origin_input_ids) if mean else req.pooled
            opts = req.options
            if opts.dimensions is not None:  # truncated first, then normalised: Matryoshka's order
                vector = vector[: opts.dimensions]
            if self.pooling.normalize if opts.normalize is None else opts.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            req.embedding = vector.numpy().astype("<f4").tobytes()

    def _accept(
        self, req: Req, result: StepResult, j: int, drafts: list[int], parents: list[int] | None, kv_start: int,
        force_send: bool,
    ) -> list[TokenOut]:
        """The request's newly sampled tokens (rows j.., one more than its drafts): the ones the
        drafts agree with (`parents`: a tree's, along its path), each recorded and checked against
        the stop conditions in turn (the first stop, or a jump-forward, ends the step's tokens
        there); then stream them.

        KV: the step computed positions [kv_start, kv_start + 1 + len(drafts)); of those, the first
        as many as tokens were taken are kept (the newest input token's and the accepted drafts',
        a tree's moved to the positions their path gives), so the newest token has no KV, as after
        any decode step, and the rest is freed now."""
        samples = result.next_ids[j : j + len(drafts) + 1]
        if parents is None:
            tokens = accepted_tokens(drafts, samples)
            rows = list(range(len(tokens)))  # each emitted token's sampled row
        else:
            tokens, nodes = accepted_path(drafts, parents, samples)
            rows = [0] + [1 + n for n in nodes]
            if req.kv is not None:
                self.kv.keep_path(req, kv_start, nodes)
            if self.spec is not None:
                self.spec.kept_rows(req, rows)
        if self.spec is not None and drafts:
            self.spec.record(len(drafts), len(tokens) - 1)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        req.steps_since_send += 1
        error, jumped = None, False
        for t, token in enumerate(tokens):
            known = len(req.output_ids) + 1
            req.output_ids.append(token)
            logprob = result.logprobs[j + rows[t]] if j + rows[t] < len(result.logprobs) else None
            if logprob is not None:
                req.pending_logprobs.append(logprob[0])
                req.pending_top_logprobs.append(logprob[1])
            self.counters.generated_tokens += 1
            try:
                req.finished_reason = self.grammar.check_token(req)
            except Exception as exc:
                error = exc
            jumped = len(req.output_ids) > known  # jump-forward appended a forced continuation
            if req.finished or error is not None or jumped:
                tokens = tokens[: t + 1]
                break
        if drafts and req.kv is not None:
            self.kv.truncate(req, kv_start + len(tokens))
        if error is not None:
            return [self._fail(req, error)]
        if req.finished:
            return [self._finish(req)]
        if jumped and req.seq_len - req.kv_len > 1:
            req.decoding = False  # the next step extends [kv_len, seq_len) (the chunked-prefill path)
        if req.options.stream and (force_send or req.steps_since_send >= self.sc.stream_interval):
            return [make_token_out(req, finished=False)]
        return []

    def _fail_step(self, batch: StepBatch, exc: BaseException) -> list[TokenOut]:
        if tp_size() > 1:
            # With tensor parallelism a forward that failed on this rank left its peers waiting in
            # a collective: the ranks are out of step for good, so the process ends (and the engine
            # reports itself dead) instead of failing the batch and serving on.
            logger.error("forward failed on a tensor-parallel rank; scheduler stopping", exc_info=exc)
            raise SystemExit(1)
        logger.error("%s forward of %d requests failed; failing them", batch.mode.name, len(batch.reqs), exc_info=exc)
        # Their KV from this step was never computed: `release` caches only committed KV.
        return [self._finish(r, _internal_error(exc)) for r in batch.reqs if not r.finished and r.kv is not None]

    def _fail(self, req: Req, exc: BaseException) -> TokenOut:
        """One request's processing raised: end it alone, its KV released now."""
        logger.error("request %s failed; aborting it", req.rid, exc_info=exc)
        return self._finish(req, _internal_error(exc))

    def _finish(self, req: Req, reason: FinishReason | None = None) -> TokenOut:
        if reason is not None:
            req.finished_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # retracted while its last step ran
            self.waiting.remove(req)
        if self.spec is not None:  # first: an EAGLE-3 head computes what the tree is about to take
            self.spec.release(req)
        self.kv.release(req)
        return make_token_out(req, finished=True)

    # ---- stats ----
    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            total_slots=self.runner.token_to_kv_pool.num_slots,
            free_slots=self.runner.token_to_kv_pool.available_size(),
            tree_slots=self.tree.total_size(),
            evictable_slots=self.tree.evictable_size(),
            cache_hit_rate=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            extra={
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "generated_tokens": c.generated_tokens,
                "retractions": c.retractions,
                "new_token_ratio": self.new_token_ratio,
                "jump_forward_tokens": self.grammar.jumped_tokens,
                **(vars(self.spec.counters) if self.spec is not None else {}),
            },
        )

    def _log_stats(self) -> None:
        c, now = self.counters, time.perf_counter()
        throughput = (c.generated_tokens - c.last_log_tokens) / max(now - c.last_log_time, 1e-9)
        c.last_log_time, c.last_log_tokens = now, c.generated_tokens
        s = self.stats()
        used = s.total_slots - s.free_slots - s.evictable_slots
        logger.info(
            "decode: running %d, queued %d, tokens in use %d, pool usage %.2f, gen throughput %.1f tok/s, "
            "cache hit rate %.2f",
            s.num_running, s.num_waiting, used, used / s.total_slots, throughput, s.cache_hit_rate,
        )


def _internal_error(exc: BaseException) -> FinishReason:
    return FinishReason("abort", message=f"internal error: {type(exc).__name__}: {exc}"[:500])
