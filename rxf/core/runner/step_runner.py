"""The runner's half of a step: a `StepBatch` becomes a forward, sampling, and one device-to-host copy.

`launch` builds the `ModelInput`, runs the forward, samples the sampled rows (penalties, grammar
masks, seeds), computes the logprobs asked for, packs ids and logprobs into one float64 tensor and
starts its copy to the host; `resolve` waits for that copy and unpacks it. On CUDA the launch only
enqueues work, so it returns while the GPU runs; on the CPU, with overlap on, it runs in one worker
thread (torch releases the GIL in its kernels), so the scheduler can plan the next step meanwhile.
Launches run in order, one at a time, so a launch may read the previous one's sampled ids on the
device (`StepBatch.prev_rows`) without waiting for the host to see them.

Speculative decoding: a request with draft tokens (`StepBatch.drafts`) is an extend of its newest
token and its drafts over its cached prefix; every one of those positions is sampled like a decode
row of the history before it (`rxf/core/speculative/accept.py` says why this verifies them). Where
a decode graph holds such a batch it replays as DECODE rows (`ModelRunner._extend_rows`), else it
runs as an eager extend.

Faults: a forward that raises fails its step (`StepResult.error`); sampling that raises is retried
row by row, so that only the requests at fault fail (`StepResult.row_errors`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rxf.core.forward import ForwardMode
from rxf.core.runner.faults import FaultInjector
from rxf.core.runner.sampling import (
    GrammarMask,
    SamplingBatch,
    make_generator,
    pack_logprobs,
    unpack_logprobs,
)
from rxf.core.runner.step_io import StepBatch, StepResult
from rxf.core.runner.step_profiler import StepProfiler

if TYPE_CHECKING:
    from rxf.core.runner.model_runner import ModelInput, ModelRunner
    from rxf.core.scheduler.req import Req

logger = logging.getLogger(__name__)


@dataclass
class _Layout:
    """Where each part of a step's packed result lies in the flat float64 vector."""

    num_sampled: int = 0
    logprob_rows: list[int] = field(default_factory=list)  # sampled rows that asked for logprobs
    logprob_top_k: list[int] = field(default_factory=list)
    # (request index, top_k, number of prompt positions scored) in order
    prompt: list[tuple[int, int, int]] = field(default_factory=list)
    pooled: bool = False  # an embedding step: the result is a float32 [requests, hidden] tensor


@dataclass
class _Done:
    """A launched step's device work (or its failure)."""

    layout: _Layout
    host: torch.Tensor | None = None  # the packed result; pinned host memory on CUDA
    event: torch.cuda.Event | None = None
    row_errors: dict[int, BaseException] = field(default_factory=dict)
    error: BaseException | None = None
    aux_hidden: torch.Tensor | None = None  # the target's auxiliary hidden states (EAGLE-3), on the device


@dataclass
class StepHandle:
    batch: StepBatch
    done: _Done | None = None
    future: concurrent.futures.Future[_Done] | None = None


class StepExecutor:
    def __init__(self, runner: ModelRunner, background: bool) -> None:
        self.runner = runner
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rxf-step") if background else None
        self._last_ids: torch.Tensor | None = None  # the previous launch's sampled ids, on the device
        self.faults = FaultInjector.from_env()  # test-only; None unless RXF_FAULT_INJECT is set
        self.profiler: StepProfiler | None = None

    # ---- profiling ----
    def start_profile(self, out_dir: Path, num_steps: int | None, kernels: bool) -> None:
        if self.profiler is not None:
            raise ValueError(f"a profile is already running (into {self.profiler.out_dir})")
        self.profiler = StepProfiler.start(out_dir, num_steps, kernels, self.device)

    def stop_profile(self) -> Path:
        """Write the running profile; its folder. A step still in flight is left out of it."""
        if self.profiler is None:
            raise ValueError("no profile is running (one started with num_steps stops by itself)")
        profiler, self.profiler = self.profiler, None
        return profiler.finish()

    # ---- launch ----
    def launch(self, batch: StepBatch) -> StepHandle:
        if self._pool is not None:
            return StepHandle(batch, future=self._pool.submit(self._run, batch))
        return StepHandle(batch, done=self._run(batch))

    def _run(self, batch: StepBatch) -> _Done:
        profiler = self.profiler
        if profiler is None or profiler.done:
            return self._forward_and_sample(batch)
        begun = profiler.begin()
        done = self._forward_and_sample(batch)
        profiler.end(batch, begun)
        return done

    def _forward_and_sample(self, batch: StepBatch) -> _Done:
        layout = _Layout()
        try:
            if self.faults is not None:
                self.faults.check("forward", batch.reqs)
            inp, starts = self._model_input(batch)
            logits, aux = self.runner.forward_with_aux(inp)
            if self.runner.pooling is not None:  # an embedding model: hidden states, nothing sampled
                with torch.inference_mode():
                    return self._pooled(inp, logits, layout)
        except Exception as exc:
            self._last_ids = None
            return _Done(layout, error=exc)
        with torch.inference_mode():
            done = self._sample_and_pack(batch, inp, starts, logits, layout)
        done.aux_hidden = aux
        return done

    def _model_input(self, batch: StepBatch) -> tuple[ModelInput, list[int]]:
        """The forward's input, and each request's first logits row."""
        from rxf.core.runner.model_runner import ModelInput, PendingTokens

        decode = batch.mode == ForwardMode.DECODE and not batch.drafts
        # A request with drafts needs the logits of its newest token and of each draft.
        logits_start = [
            e - 1 - len(batch.draft_of(i)) if p is None else p - pre
            for i, (p, pre, e) in enumerate(zip(batch.prompt_logits_from, batch.prefix_lens, batch.extend_lens, strict=True))
        ]
        pooling = self.runner.pooling
        if pooling is not None and pooling.method == "mean":  # every new token's state is pooled
            logits_start = [0] * len(logits_start)
        starts, row = [], 0
        for s, e in zip(logits_start, batch.extend_lens, strict=True):
            starts.append(row)
            row += e - s
        pending = None
        last_tokens = [i for i, prev in enumerate(batch.prev_rows) if prev >= 0]
        if last_tokens:
            ends, t = [], 0
            for e in batch.extend_lens:
                t += e
                ends.append(t - 1)
            source = self._last_ids
            if source is None:  # the previous step failed: its requests have failed too
                source = torch.zeros(max(batch.prev_rows) + 1, dtype=torch.int64, device=self.device)
            pending = PendingTokens([ends[i] for i in last_tokens], [batch.prev_rows[i] for i in last_tokens], source)
        if decode:
            mode = ForwardMode.DECODE
        else:
            mode = ForwardMode.EXTEND if any(batch.prefix_lens) else ForwardMode.PREFILL
        mm_items = [r.prepared.mm_items for r in batch.reqs]
        inp = ModelInput(
            mode=mode,
            req_pool_indices=batch.rows,
            input_ids=batch.input_ids,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            out_cache_loc=batch.out_cache_loc,
            row_writes=batch.row_writes if any(w is not None for w in batch.row_writes) else None,
            logits_start=None if decode else logits_start,
            mm_items=mm_items if any(mm_items) else None,
            pending=pending,
            tree_parents=batch.draft_parents,
        )
        return inp, starts

    def _pooled(self, inp: ModelInput, hidden: torch.Tensor, layout: _Layout) -> _Done:
        """Each request's part of its embedding from this step's rows `hidden` (its new tokens'
        final states for mean pooling, else its last token's): their float32 sum for mean pooling
        (the scheduler adds a chunked prompt's parts and divides by its length), else the row."""
        assert self.runner.pooling is not None
        hidden = hidden.float()
        if self.runner.pooling.method == "mean":
            counts = torch.tensor(inp.extend_lens).to(hidden.device, non_blocking=True)
            owner = torch.arange(len(inp.extend_lens), device=hidden.device).repeat_interleave(counts)
            hidden = torch.zeros(len(inp.extend_lens), hidden.shape[1], device=hidden.device).index_add_(0, owner, hidden)
        layout.pooled = True
        done = _Done(layout)
        _copy_to_host(done, hidden)
        return done

    def _sample_and_pack(
        self, batch: StepBatch, inp: ModelInput, starts: list[int], logits: torch.Tensor, layout: _Layout
    ) -> _Done:
        done = _Done(layout)
        parts: list[torch.Tensor] = []
        # Sampled rows as (request, position among its last num_samples logits rows).
        sampled = [(i, t) for i in range(len(batch.reqs)) for t in range(batch.num_samples(i))]
        next_ids = None
        if sampled:
            rows = [
                starts[i] + inp.extend_lens[i] - (inp.logits_start[i] if inp.logits_start else 0)
                - batch.num_samples(i) + t
                for i, t in sampled
            ]
            last = logits if rows == list(range(logits.shape[0])) else logits[
                torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            ]
            next_ids, packed = self._sample_rows(batch, sampled, last, layout, done)
            parts.append(next_ids.double())
            if packed is not None:
                parts.append(packed.view(-1))
        layout.num_sampled = len(sampled)
        self._last_ids = next_ids
        for i, p in enumerate(batch.prompt_logits_from):
            if p is None:
                continue
            try:
                parts.append(self._prompt_logprobs(batch.reqs[i], logits, starts[i], p, layout, i))
            except Exception as exc:
                done.row_errors[i] = exc
        if parts:
            _copy_to_host(done, torch.cat(parts) if len(parts) > 1 else parts[0])
        return done

    def _sample_rows(
        self, batch: StepBatch, sampled: list[tuple[int, int]], logits: torch.Tensor, layout: _Layout, done: _Done
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next ids [n] and packed output logprobs of the rows that asked; a batch failure is
        retried row by row, and a row that still fails samples token 0 and is reported (for its
        request). `sampled[j]` = (request index, position t: sampled after its drafts[:t])."""
        reqs = [batch.reqs[i] for i, _ in sampled]
        ahead = [batch.ahead(i, t) for i, t in sampled]
        layout.logprob_rows = [j for j, r in enumerate(reqs) if r.options.return_logprob]
        layout.logprob_top_k = [reqs[j].options.top_logprobs_num for j in layout.logprob_rows]
        try:
            return self._sample(reqs, ahead, logits, batch.banned_ids, batch.grammar, layout)
        except Exception:
            logger.warning("sampling a batch of %d failed; retrying one by one", len(reqs), exc_info=True)
        ids, packs = [], []
        k_max = max(layout.logprob_top_k, default=0)
        for j, req in enumerate(reqs):
            grammar = None
            if batch.grammar is not None and j in batch.grammar.rows:
                grammar = GrammarMask(batch.grammar.bitmask[j : j + 1], [0], batch.grammar.apply)
            sub = _Layout(logprob_rows=[0] if req.options.return_logprob else [], logprob_top_k=[k_max])
            try:
                one, packed = self._sample(
                    [req], ahead[j : j + 1], logits[j : j + 1], batch.banned_ids[j : j + 1], grammar, sub
                )
            except Exception as exc:
                done.row_errors[sampled[j][0]] = exc
                one = torch.zeros(1, dtype=torch.int64, device=logits.device)
                packed = torch.zeros(1, 1 + 2 * k_max, dtype=torch.float64, device=logits.device)
                packed = packed if req.options.return_logprob else None
            ids.append(one)
            if packed is not None:
                packs.append(packed)
        return torch.cat(ids), (torch.cat(packs) if packs else None)

    def _sample(
        self, reqs: list[Req], ahead: list[list[int]], logits: torch.Tensor, banned: list[list[int]],
        grammar: GrammarMask | None, layout: _Layout,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row j samples for reqs[j] as if `ahead[j]` (its drafts before that position) were
        already output: penalties see them in its history."""
        if self.faults is not None:
            self.faults.check("sample", reqs)
        if grammar is not None:
            grammar = GrammarMask(grammar.bitmask.to(logits.device, non_blocking=True), grammar.rows, grammar.apply)
        # Only penalised rows read their history (the scheduler never leaves theirs in flight).
        history = [r.sampling_params.reads_history for r in reqs]
        batch = SamplingBatch.build(
            [r.sampling_params for r in reqs],
            [r.origin_input_ids if h else [] for r, h in zip(reqs, history, strict=True)],
            [r.output_ids + a if h else [] for r, a, h in zip(reqs, ahead, history, strict=True)],
            [self._generator(r) for r in reqs],
            self.vocab_size,
            logits.device,
            banned_ids=banned,
            grammar_mask=grammar,
        )
        out = batch.sample(logits)
        if not layout.logprob_rows:
            return out.next_token_ids, None
        rows = torch.tensor(layout.logprob_rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        return out.next_token_ids, pack_logprobs(out.logprobs[rows], out.next_token_ids[rows], layout.logprob_top_k)

    def _generator(self, req: Req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is not None and req.generator is None:
            req.generator = make_generator(seed, self.device)
        return req.generator

    def _prompt_logprobs(
        self, req: Req, logits: torch.Tensor, first_row: int, abs_start: int, layout: _Layout, index: int
    ) -> torch.Tensor:
        """Packed logprobs of the prompt tokens at positions abs_start + 1 .. (row j of the
        request's logits scores position abs_start + j + 1; the last row predicts the output)."""
        prompt = req.origin_input_ids
        n = len(prompt) - 1 - abs_start
        rows = logits[first_row : first_row + n].float().log_softmax(dim=-1)
        targets = torch.tensor(prompt[abs_start + 1 :], dtype=torch.int64).to(logits.device, non_blocking=True)
        top_k = req.options.top_logprobs_num
        layout.prompt.append((index, top_k, n))
        return pack_logprobs(rows, targets, [top_k] * n).view(-1)

    # ---- resolve ----
    def resolve(self, handle: StepHandle) -> StepResult:
        done = handle.future.result() if handle.future is not None else handle.done
        assert done is not None
        if self.profiler is not None and self.profiler.done:  # it had its steps: write it
            self.stop_profile()
        if done.error is not None:
            return StepResult(error=done.error)
        if done.event is not None:
            done.event.synchronize()
        if done.layout.pooled:
            return StepResult(pooled=done.host)
        flat: list[float] = done.host.tolist() if done.host is not None else []
        result = _unpack(handle.batch, done, flat, self.vocab_size)
        result.aux_hidden = done.aux_hidden
        return result


def _copy_to_host(done: _Done, result: torch.Tensor) -> None:
    """Start the step's one device-to-host copy of `result` (pinned memory, with an event to wait on)."""
    if result.is_cuda:
        done.host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
        done.host.copy_(result, non_blocking=True)
        done.event = torch.cuda.Event()
        done.event.record()
    else:
        done.host = result


def _unpack(batch: StepBatch, done: _Done, flat: list[float], vocab_size: int) -> StepResult:
    layout = done.layout
    n = layout.num_sampled
    result = StepResult(next_ids=[int(t) for t in flat[:n]], logprobs=[None] * n, row_errors=done.row_errors)
    pos = n
    if layout.logprob_rows:
        k_max = max(min(max(layout.logprob_top_k, default=0), vocab_size), 0)
        width = (1 + 2 * k_max) * len(layout.logprob_rows)
        chosen, top = unpack_logprobs(flat[pos : pos + width], layout.logprob_top_k, vocab_size)
        for k, j in enumerate(layout.logprob_rows):
            result.logprobs[j] = (chosen[k], top[k])
        pos += width
    for index, top_k, count in layout.prompt:
        width = (1 + 2 * max(min(top_k, vocab_size), 0)) * count
        values, tops = unpack_logprobs(flat[pos : pos + width], [top_k] * count, vocab_size)
        pos += width
        req = batch.reqs[index]
        first = max(req.options.logprob_start_len, 0)
        lead: list[Any] = [None] if first == 0 else []
        result.prompt_logprobs[index] = {
            "ids": req.origin_input_ids[first:],
            "values": lead + values,
            "tops": ([[]] if first == 0 else []) + tops,
        }
    return result
