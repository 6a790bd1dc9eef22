"""The scheduler: one `step()` = receive, pick an EXTEND or a DECODE batch, run it, emit outputs.

It deals in requests, slot indices and token counts; `ModelRunner` alone builds tensors. Usable
in-process (tests drive `add_request` / `step` directly) and from the scheduler process loop.

Faults: a forward that raises fails the requests of its batch; an exception in one request's own
processing after the forward (its sampling, prompt logprobs or stop check) fails that request only.
Either way the failed requests end with an "abort" carrying the error and their KV is released at
once, and the scheduler keeps serving the others. Anything else (a bookkeeping bug) propagates and
ends the process: its state could no longer be trusted.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

import torch

from rxf.core.config import EngineConfig
from rxf.core.distributed import tp_size
from rxf.core.forward import ForwardMode
from rxf.core.io_struct import ABORT_REQUESTED, FinishReason, SchedulerStats, TokenizedGenerateReq, TokenOut
from rxf.core.model_runner import ModelInput, ModelRunner
from rxf.core.radix_cache import RadixCache
from rxf.core.sampling import make_generator
from rxf.core.scheduler.admission import admit
from rxf.core.scheduler.cache_ops import KVCacheManager
from rxf.core.scheduler.constrained import ConstrainedDecoding
from rxf.core.scheduler.faults import FaultInjector
from rxf.core.scheduler.output import (
    StopChecker,
    make_token_out,
    record_output_logprobs,
    record_prompt_logprobs,
    sample_next,
)
from rxf.core.scheduler.policy import order_waiting
from rxf.core.scheduler.req import Req

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


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer, check_memory: bool = False) -> None:
        self.config = config
        self.sc = config.scheduler
        self.runner = runner
        self.tree = RadixCache(runner.token_to_kv_pool, disable=config.cache.disable_radix_cache)
        self.kv = KVCacheManager(runner.req_to_token_pool, runner.token_to_kv_pool, self.tree)
        eos = set(runner.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.stop = StopChecker(tokenizer, sorted(eos), runner.max_context_len)
        self.grammar = ConstrainedDecoding.create(config, tokenizer, runner.vocab_size, self.stop)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # requests with a req_to_token row (decoding or mid-prefill)
        self.new_token_ratio = self.sc.init_new_token_ratio
        self.rng = random.Random(config.runtime.seed)
        self.check_memory = check_memory
        self.counters = _Counters(last_log_time=time.perf_counter())
        self._arrivals = itertools.count()
        self.faults = FaultInjector.from_env()  # test-only; None unless RXF_FAULT_INJECT is set

    # ---- requests in ----
    def add_request(self, msg: TokenizedGenerateReq) -> TokenOut | None:
        """Queue a request; returns an immediate finished output when it cannot ever run."""
        req = Req.from_tokenized(msg)
        req.arrival = next(self._arrivals)
        error = self._validate(req)
        if error is not None:
            req.finished_reason = FinishReason("abort", message=error)
            return make_token_out(req, finished=True)
        if req.sampling_params.seed is not None:
            req.generator = make_generator(req.sampling_params.seed, self.runner.device)
        self.grammar.submit(req)
        self.waiting.append(req)
        return None

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.runner.max_context_len:
            return f"the prompt has {n} tokens; the model's context length is {self.runner.max_context_len}"
        bad = [t for t in req.origin_input_ids if not 0 <= t < self.runner.vocab_size]
        if bad:
            return f"input_ids contains token ids outside [0, {self.runner.vocab_size}): {bad[:5]}"
        if n + 1 > self.runner.max_total_tokens:
            return f"the prompt has {n} tokens; the KV cache holds only {self.runner.max_total_tokens}"
        return None

    def abort(self, rid: str) -> list[TokenOut]:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = FinishReason("abort", message=ABORT_REQUESTED)
                return [make_token_out(req, finished=True)]
        for req in self.running:
            if req.rid == rid:
                req.to_abort = True  # released at the end of the current step
        return []

    def flush_cache(self) -> tuple[bool, str]:
        if self.running or self.waiting:
            return False, f"cannot flush the cache while {len(self.running) + len(self.waiting)} requests are in flight"
        self.tree.reset()
        self.runner.token_to_kv_pool.clear()
        self.runner.req_to_token_pool.clear()
        return True, "cache flushed"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def step(self) -> list[TokenOut]:
        outs = self._release_aborted()
        outs += [make_token_out(r, finished=True) for r in self.grammar.resolve(self.waiting)]
        extend = self._schedule_extend()
        if extend:
            outs += self._run_extend(extend)
        elif self.running:
            outs += self._run_decode()
        else:  # only grammars still compiling (if anything): wait for one rather than spin
            self.grammar.wait(self.waiting, timeout=0.01)
        if self.check_memory:
            self.kv.check(self.running)
        return outs

    def _release_aborted(self) -> list[TokenOut]:
        outs = []
        for req in [r for r in self.running if r.to_abort]:
            req.finished_reason = FinishReason("abort", message=ABORT_REQUESTED)
            outs.append(self._finish(req))
        return outs

    # ---- extend ----
    def _schedule_extend(self) -> list[tuple[Req, torch.Tensor]]:
        """The next EXTEND batch: unfinished chunked prefills first, then newly admitted requests."""
        batch = self._continue_chunked()
        if not self.waiting:
            return batch
        decoding = [r for r in self.running if r.decoding]
        adm = admit(
            order_waiting([r for r in self.waiting if self.grammar.ready(r)], self.sc.policy, self.kv, self.rng),
            decoding,
            self.kv,
            new_token_ratio=self.new_token_ratio,
            max_prefill_tokens=self.sc.max_prefill_tokens - sum(int(s.numel()) for _, s in batch),
            chunk_size=self.sc.chunked_prefill_size,
            free_rows=self.runner.req_to_token_pool.available_size(),
            batch_nonempty=bool(batch),
        )
        for req, extend_len in zip(adm.reqs, adm.extend_lens, strict=True):
            slots = self.kv.alloc_slots(extend_len)
            if slots is None:  # eviction freed less than admission counted on: retry next step
                for late in adm.reqs[adm.reqs.index(req) :]:
                    self.kv.unlock(late)
                    late.prefix_indices, late.kv_len = late.prefix_indices[:0], 0
                break
            req.req_pool_idx = self.runner.req_to_token_pool.alloc()
            self.waiting.remove(req)
            if req.cached_tokens is None:
                req.cached_tokens = req.cached_len
                self.counters.prompt_tokens += len(req.origin_input_ids)
                self.counters.cached_tokens += req.cached_len
            batch.append((req, slots))
        return batch

    def _continue_chunked(self) -> list[tuple[Req, torch.Tensor]]:
        """Next chunk of each request whose prompt is only partly prefilled (they keep row and lock)."""
        batch = []
        chunk = self.sc.chunked_prefill_size or self.sc.max_prefill_tokens
        for req in [r for r in self.running if not r.decoding]:
            slots = self.kv.alloc_slots(min(chunk, req.seq_len - req.kv_len))
            if slots is None:
                break
            self.running.remove(req)  # re-added after the forward
            batch.append((req, slots))
        return batch

    def _run_extend(self, batch: list[tuple[Req, torch.Tensor]]) -> list[TokenOut]:
        reqs = [r for r, _ in batch]
        input_ids: list[int] = []
        logits_start = []
        for req, slots in batch:
            input_ids += req.fill_ids[req.kv_len : req.kv_len + slots.numel()]
            start = req.prompt_logits_from() - req.kv_len if req.wants_prompt_logprobs() else slots.numel() - 1
            logits_start.append(start)
        inp = ModelInput(
            mode=ForwardMode.EXTEND if any(r.kv_len for r in reqs) else ForwardMode.PREFILL,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            input_ids=input_ids,
            prefix_lens=[r.kv_len for r in reqs],
            extend_lens=[int(s.numel()) for _, s in batch],
            out_cache_loc=torch.cat([s for _, s in batch]),
            prefix_slots=[self._prefix_slots(r) for r in reqs],
            logits_start=logits_start,
            mm_items=[r.mm_items for r in reqs] if any(r.mm_items for r in reqs) else None,
        )
        try:
            logits = self._forward(inp, reqs)
        except Exception as exc:
            logger.exception("EXTEND forward of %d requests failed; failing them", len(reqs))
            for req, slots in batch:
                self._free_slots(slots)  # this forward's slots: not yet part of the request's KV
                self.running.append(req)
            return [self._finish(r, _internal_error(exc)) for r in reqs]
        # Bookkeeping first (it cannot fail per request), then each request's own processing.
        spans, row = [], 0  # per request: first logits row, rows, absolute position of the first
        for (req, slots), start in zip(batch, logits_start, strict=True):
            n_rows = int(slots.numel()) - start
            spans.append((row, n_rows, req.kv_len + start))
            req.kv_len += int(slots.numel())
            row += n_rows
            self.running.append(req)
        for req in reqs:
            self.kv.cache_unfinished(req)
        # Only requests whose prompt is now complete sample.
        outs, ready, last_rows = [], [], []
        for req, (first, n_rows, abs_start) in zip(reqs, spans, strict=True):
            if req.wants_prompt_logprobs():
                try:
                    record_prompt_logprobs(req, logits[first : first + n_rows], abs_start)
                except Exception as exc:
                    outs.append(self._fail(req, exc))
                    continue
            if req.kv_len == req.seq_len:
                ready.append(req)
                last_rows.append(first + n_rows - 1)
        # max_new_tokens = 0 (prefill only: prompt logprobs, or warming the cache for n > 1).
        outs += [self._finish(r, FinishReason("length")) for r in ready if r.sampling_params.max_new_tokens == 0]
        last_rows = [row for r, row in zip(ready, last_rows, strict=True) if r.sampling_params.max_new_tokens]
        ready = [r for r in ready if r.sampling_params.max_new_tokens]
        if ready:
            outs += self._sample_and_emit(ready, logits[torch.tensor(last_rows, device=logits.device)], force_send=True)
        return outs

    def _prefix_slots(self, req: Req) -> torch.Tensor:
        """Slots of the request's KV before this forward, for its req_to_token row."""
        if req.kv_len == req.cached_len:
            return req.prefix_indices
        return self.kv.row_slots(req)

    # ---- decode ----
    def _run_decode(self) -> list[TokenOut]:
        decoding = [r for r in self.running if r.decoding]
        if not decoding:
            return []
        decoding = self._ensure_decode_space(decoding)
        slots = self.kv.alloc_slots(len(decoding))
        if slots is None:  # a lone request that outgrew the whole cache
            req = decoding[0]
            req.finished_reason = FinishReason("length", message="the KV cache is full")
            return [self._finish(req)]
        inp = ModelInput(
            mode=ForwardMode.DECODE,
            req_pool_indices=[r.req_pool_idx for r in decoding],
            input_ids=[r.output_ids[-1] for r in decoding],
            prefix_lens=[r.kv_len for r in decoding],
            extend_lens=[1] * len(decoding),
            out_cache_loc=slots,
        )
        try:
            logits = self._forward(inp, decoding)
        except Exception as exc:
            logger.exception("DECODE forward of %d requests failed; failing them", len(decoding))
            self._free_slots(slots)
            return [self._finish(r, _internal_error(exc)) for r in decoding]
        for req in decoding:
            req.kv_len += 1
        self.counters.decode_steps += 1
        self.new_token_ratio = max(self.new_token_ratio - self.sc.new_token_ratio_decay, self.sc.min_new_token_ratio)
        outs = self._sample_and_emit(decoding, logits, force_send=False)
        if self.counters.decode_steps % self.sc.log_interval == 0:
            self._log_stats()
        return outs

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
            decoding, key=lambda r: (-r.priority, len(r.output_ids), -len(r.origin_input_ids), -r.arrival)
        )
        while self.kv.available() < len(decoding) and len(decoding) > 1:
            victim = order.pop(0)
            decoding.remove(victim)
            self.running.remove(victim)
            self.kv.release(victim)
            self.waiting.insert(0, victim)
            self.counters.retractions += 1
            logger.info(
                "KV cache full: retracted request %s (priority %d) after %d tokens",
                victim.rid, victim.priority, len(victim.output_ids),
            )
        self.new_token_ratio = self.sc.init_new_token_ratio
        return decoding

    # ---- after sampling ----
    def _sample_and_emit(self, reqs: list[Req], logits: torch.Tensor, force_send: bool) -> list[TokenOut]:
        outs: list[TokenOut] = []
        try:
            sampled = self._sample(reqs, logits)
        except Exception:
            # One request's parameters may be at fault: sample each alone so that only it fails.
            logger.warning("sampling a batch of %d failed; retrying one by one", len(reqs), exc_info=True)
            sampled = []
            for i, req in enumerate(reqs):
                try:
                    sampled += self._sample([req], logits[i : i + 1])
                except Exception as exc:
                    outs.append(self._fail(req, exc))
        for req, token in sampled:
            req.output_ids.append(token)
            req.decoding = True
            self.counters.generated_tokens += 1
            req.steps_since_send += 1
            try:
                req.finished_reason = self.grammar.check_token(req)
            except Exception as exc:
                outs.append(self._fail(req, exc))
                continue
            if req.finished:
                outs.append(self._finish(req))
            elif req.stream and (force_send or req.steps_since_send >= self.sc.stream_interval):
                outs.append(make_token_out(req, finished=False))
        return outs

    def _forward(self, inp: ModelInput, reqs: list[Req]) -> torch.Tensor:
        if self.faults is not None:
            self.faults.check("forward", reqs)
        try:
            return self.runner.forward(inp)
        except Exception:
            if tp_size() == 1:
                raise
            # With tensor parallelism a forward that failed on this rank left its peers waiting in
            # a collective: the ranks are out of step for good, so the process ends (and the engine
            # reports itself dead) instead of failing the batch and serving on.
            logger.exception("forward failed on a tensor-parallel rank; scheduler stopping")
            raise SystemExit(1) from None

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> list[tuple[Req, int]]:
        """Next token per request, with its output logprobs recorded; changes no request on failure
        (logprobs are recorded last, by a loop that only appends)."""
        if self.faults is not None:
            self.faults.check("sample", reqs)
        grammar_mask = self.grammar.mask(reqs, logits.device)
        next_ids, logprobs = sample_next(reqs, logits, self.stop, self.runner.vocab_size, grammar_mask)
        if logprobs is not None and any(r.return_logprob for r in reqs):
            record_output_logprobs(reqs, logprobs, next_ids)
        return list(zip(reqs, next_ids, strict=True))

    def _free_slots(self, slots: torch.Tensor) -> None:
        self.runner.token_to_kv_pool.free(slots)

    def _fail(self, req: Req, exc: Exception) -> TokenOut:
        """One running request's processing raised: end it alone, its KV released now."""
        logger.error("request %s failed; aborting it", req.rid, exc_info=exc)
        return self._finish(req, _internal_error(exc))

    def _finish(self, req: Req, reason: FinishReason | None = None) -> TokenOut:
        if reason is not None:
            req.finished_reason = reason
        self.running.remove(req)
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


def _internal_error(exc: Exception) -> FinishReason:
    return FinishReason("abort", message=f"internal error: {type(exc).__name__}: {exc}"[:500])
