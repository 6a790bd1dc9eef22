"""Structured output in the scheduler: compile off the loop, mask each step, advance, jump forward.

A constrained request enters the waiting queue with its grammar compiling on a thread pool and is
not admitted until the compile is done; other requests keep running meanwhile. Its matcher then
accepts every output token. With tensor parallelism (tp_size > 1) every rank compiles the same
grammars and `resolve` waits for all pending compiles, so that which requests are admissible depends
only on the broadcast request stream, never on one rank's thread timing (ranks that disagreed on a
batch would deadlock in their collectives). It needs no rollback on retraction: a retracted request keeps its
output (`Scheduler._ensure_decode_space`), so matcher and `output_ids` still agree.

With overlap scheduling, a step that samples for a constrained request is resolved before the next
step is planned (`Scheduler.step`): its matcher must accept the token before it can mask the next.

A constraint with `grammar_after` (a thinking model's end-of-reasoning tokens) sleeps until the
output ends with them: no mask, no matcher step. The token that completes them starts it
(`grammar_start`), and the next sampled token is the grammar's first.

Jump-forward (the compressed FSM of the SGLang paper): when the grammar allows a single continuation
string, it is tokenized together with the newest token and appended at once; the request then
extends those tokens in one EXTEND instead of one DECODE each. Only the newest token is ever
replaced: it has no KV yet (kv_len == seq_len - 1) and has not been sent to the detokenizer (the
jump runs before the step's output is built), so no KV and no detokenizer offset needs repair.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from rxf.core.config import EngineConfig
from rxf.core.grammar import GrammarBackend, make_grammar_backend
from rxf.core.ipc.messages import FinishReason
from rxf.core.runner.sampling import GrammarMask
from rxf.core.scheduler.output import StopChecker
from rxf.core.scheduler.req import Req
from rxf.core.tokenizer_info import max_token_chars

logger = logging.getLogger(__name__)

# Tokens before the jump decoded with it, so a tokenizer that needs a neighbour decodes right.
_CONTEXT_TOKENS = 3


class GrammarViolation(RuntimeError):
    """A token the request's grammar does not allow reached its output (a sampler bug)."""


class ConstrainedDecoding:
    def __init__(self, backend: GrammarBackend, config: EngineConfig, tokenizer: Any, stop: StopChecker) -> None:
        self.backend = backend
        self.jump_forward = config.grammar.jump_forward
        self.max_jump_bytes = config.grammar.max_jump_forward_bytes
        self.max_match_s = config.grammar.max_match_ms / 1e3
        self._fill_s: dict[str, float] = {}  # rid -> this step's bitmask fill time
        # A token's text is at most max_token_chars characters of at most 4 UTF-8 bytes each.
        self.max_token_bytes = 4 * max_token_chars(tokenizer)
        self.tokenizer = tokenizer
        self.stop = stop
        self.pool = concurrent.futures.ThreadPoolExecutor(
            config.grammar.compile_threads, thread_name_prefix="rxf-grammar"
        )
        self.jumped_tokens = 0
        self.synchronous = config.parallel.tp_size > 1  # see the module docstring

    @classmethod
    def create(cls, config: EngineConfig, tokenizer: Any, vocab_size: int, stop: StopChecker) -> ConstrainedDecoding:
        return cls(make_grammar_backend(config, tokenizer, vocab_size), config, tokenizer, stop)

    # ---- before admission ----
    def submit(self, req: Req) -> None:
        """Start compiling the request's constraint (a failure aborts it in `resolve`)."""
        grammar = req.sampling_params.grammar
        if grammar is not None:
            req.grammar_future = self.pool.submit(self.backend.compile, *grammar)

    def resolve(self, waiting: list[Req]) -> list[Req]:
        """Give each waiting request whose compile finished its matcher; returns those whose compile
        failed (removed from `waiting`, `finished_reason` set)."""
        failed = []
        if self.synchronous:
            concurrent.futures.wait([r.grammar_future for r in waiting if r.grammar_future is not None])
        for req in [r for r in waiting if r.grammar_future is not None and r.grammar_future.done()]:
            future, req.grammar_future = req.grammar_future, None
            try:
                compiled = future.result()
            except Exception as exc:
                kind = req.sampling_params.grammar[0]
                req.finished_reason = FinishReason("abort", message=f"sampling_params.{kind}: {exc}", status=400)
                waiting.remove(req)
                failed.append(req)
                continue
            stops = sorted(self.stop.eos_token_ids | set(req.sampling_params.stop_token_ids))
            req.grammar = self.backend.matcher(compiled, stops)
            req.grammar_start = None if req.sampling_params.grammar_after else 0
        return failed

    @staticmethod
    def ready(req: Req) -> bool:
        return req.grammar_future is None

    @staticmethod
    def wait(waiting: list[Req], timeout: float) -> None:
        """Block up to `timeout` s for a compile to finish (called only when there is nothing to run)."""
        pending = [r.grammar_future for r in waiting if r.grammar_future is not None]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- each step ----
    def mask(self, reqs: list[Req], drafts: list[list[int]] | None = None) -> GrammarMask | None:
        """The step's bitmask for the constrained ones of `reqs` (the sampled requests), on the host;
        every constrained request has its output resolved (the scheduler sees to it). With
        `drafts` (speculative decoding) request j has 1 + len(drafts[j]) rows: the mask after each
        prefix of its drafts, which the matcher accepts in turn (`valid_prefix` checked they can)
        and then rolls back."""
        counts = [1 + len(d) for d in drafts] if drafts else [1] * len(reqs)
        firsts = [sum(counts[:j]) for j in range(len(reqs))]
        rows = [firsts[j] + t for j, r in enumerate(reqs) if r.grammar_active for t in range(counts[j])]
        if not rows:
            return None
        bitmask = self.backend.allocate_bitmask(sum(counts))
        self._fill_s.clear()  # only this step's rows: bounded by the batch
        for j, req in enumerate(reqs):
            if not req.grammar_active:
                continue
            assert req.inflight == 0, "a constrained request's mask needs its output known"
            start = time.perf_counter()
            ahead = drafts[j] if drafts else []
            for t in range(counts[j]):
                req.grammar.fill_bitmask(bitmask, firsts[j] + t)
                if t < len(ahead) and not req.grammar.accept_token(ahead[t]):
                    raise GrammarViolation(f"draft token {ahead[t]} is not allowed by the request's grammar")
            req.grammar.rollback(len(ahead))
            self._fill_s[req.rid] = time.perf_counter() - start
        return GrammarMask(bitmask, rows, self.backend.apply_bitmask)

    @staticmethod
    def valid_prefix(req: Req, drafts: list[int]) -> int:
        """How many of `drafts` the request's grammar accepts in a row (the matcher is left as it
        was): drafts from the first disallowed one on could never be accepted. A draft that would
        complete the grammar is left out too (no mask exists after it); it may still be sampled."""
        accepted, completes = 0, False
        while accepted < len(drafts) and req.grammar.accept_token(drafts[accepted]):
            accepted += 1
            completes = req.grammar.is_terminated()
            if completes:
                break
        req.grammar.rollback(accepted)
        return accepted - completes

    def check_token(self, req: Req) -> FinishReason | None:
        """Advance the matcher by the newest output token, then check the stop conditions; a
        complete grammar (stop token accepted) ends the request with "stop", one that took over
        `grammar.max_match_ms` this step (mask, accept, jump) with "abort"."""
        if req.grammar is None:
            return self.stop.check(req)
        if req.grammar_start is None:  # asleep until the output ends with `grammar_after`
            after = req.sampling_params.grammar_after
            if req.output_ids[-len(after) :] == after:
                req.grammar_start = len(req.output_ids)
            return self.stop.check(req)
        start = time.perf_counter()
        token = req.output_ids[-1]
        if not req.grammar.accept_token(token):
            if self._dead_end(req):
                # The sampler, left no token, drew one anyway: it is no output (never sent, no KV: a
                # constrained request's next step waits for this one's tokens).
                req.output_ids.pop()
                if req.options.return_logprob and req.pending_logprobs:
                    req.pending_logprobs.pop()
                    req.pending_top_logprobs.pop()
                return FinishReason("abort", status=400, message=(
                    f"sampling_params.{req.sampling_params.grammar[0]}: no text matching it continues this output: "
                    f"after {len(req.output_ids) - req.grammar_start} tokens it allows no token, not even a stop"))
            raise GrammarViolation(f"token {token} is not allowed by the request's grammar")
        reason = self.stop.check(req)
        if reason is None and req.grammar.is_terminated():
            reason = FinishReason("stop", matched=token)
        if reason is None and self.jump_forward and not req.options.return_logprob and self._jump(req):
            reason = self.stop.check(req)
        spent = self._fill_s.pop(req.rid, 0.0) + time.perf_counter() - start
        if reason is None and spent > self.max_match_s:
            # An ambiguous grammar (`x ::= x x | "a"`) costs more per token the longer its output:
            # it ends here rather than slow every step of its neighbours further.
            kind = req.sampling_params.grammar[0]
            reason = FinishReason("abort", status=400, message=(
                f"sampling_params.{kind}: the grammar took {spent * 1e3:.0f} ms to match one step's output, "
                f"over grammar.max_match_ms = {self.max_match_s * 1e3:g}"))
        return reason

    def _dead_end(self, req: Req) -> bool:
        """Whether the request's grammar allows no token where it stands: its mask was empty, so the
        sampler had nothing to pick (the backend's `validate` refuses a grammar dead from its start;
        one satisfiable only up to a point, a JSON string of a pattern no text matches, dies
        mid-output). Checked only when a token was refused: a refused token in a live grammar is a
        sampler bug."""
        bitmask = self.backend.allocate_bitmask(1)
        req.grammar.fill_bitmask(bitmask, 0)
        return not bool(bitmask.any())

    # ---- jump-forward ----
    def _jump(self, req: Req) -> bool:
        """Append the grammar's forced continuation; True if any token was added."""
        out = req.output_ids
        p = req.sampling_params
        budget = min(p.max_new_tokens - len(out), self.stop.max_context_len - 1 - req.seq_len)  # tokens
        if budget <= 0:
            return False
        # The forced text may be endless (a recursive schema): ask only for what the budget can hold,
        # at most `max_token_bytes` per token, and at most `max_jump_bytes` per step.
        forced = req.grammar.jump_forward_string(min(self.max_jump_bytes, budget * self.max_token_bytes))
        if not forced or "\ufffd" in forced:
            return False
        # The newest token is re-tokenized with the forced text (the tokenizer may merge across the
        # boundary) when it is still unsent and decodes to whole characters.
        replace = int(req.sent_len < len(out))
        new_ids = self._tokenize(out, forced, replace) if replace else None
        if new_ids is None:
            replace = 0
            new_ids = self._tokenize(out, forced, 0)
        if new_ids is None:
            return False
        new_ids = new_ids[: budget + replace]
        if len(new_ids) <= replace:  # nothing gained
            return False
        req.grammar.rollback(replace)
        accepted = 0
        while accepted < len(new_ids) and req.grammar.accept_token(new_ids[accepted]):
            accepted += 1
        if accepted < len(new_ids):  # the grammar rejects this tokenization: undo it
            req.grammar.rollback(accepted)
            if replace:
                req.grammar.accept_token(out[-1])
            return False
        out[len(out) - replace :] = new_ids
        self.jumped_tokens += len(new_ids) - replace
        # (The scheduler then extends [kv_len, seq_len) in the next step: `Scheduler._accept`.)
        return True

    def _tokenize(self, out: list[int], forced: str, replace: int) -> list[int] | None:
        """Tokens for (the newest token's text if `replace`) + `forced`, or None if re-tokenizing
        would change the text (the window's decode must read exactly as before plus `forced`)."""
        decode = self.tokenizer.decode
        head = out[len(out) - replace :]
        context = out[max(len(out) - replace - _CONTEXT_TOKENS, 0) : len(out) - replace]
        head_text = decode(head) if head else ""
        if "\ufffd" in head_text:
            return None
        new_ids = self.tokenizer.encode(head_text + forced, add_special_tokens=False)
        if decode(context + new_ids) != decode(context + head) + forced:
            return None
        return new_ids
