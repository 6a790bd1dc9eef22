"""After a step: stop conditions, and the outputs to send."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rxf.core.ipc.messages import FinishReason, TokenOut
from rxf.core.scheduler.req import Req


class StopChecker:
    """Stop conditions: EOS, stop token ids, stop strings, max_new_tokens and the context length."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], max_context_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len

    def banned_ids(self, req: Req, ahead: int = 0) -> list[int]:
        """Tokens that may not be sampled next because min_new_tokens is not reached (counting the
        tokens in flight and `ahead` drafts before the position: it is output number
        `req.generated + ahead`)."""
        p = req.sampling_params
        # A grammar decides when its output may end: banning its stop tokens could leave no token.
        if req.generated + ahead >= p.min_new_tokens or req.grammar is not None:
            return []
        return list(req.stop_token_set) + ([] if p.ignore_eos else list(self.eos_token_ids))

    def check(self, req: Req) -> FinishReason | None:
        """Whether the newest known output token ends the request."""
        p = req.sampling_params
        token = req.output_ids[-1]
        if len(req.output_ids) >= p.min_new_tokens:
            if token in req.stop_token_set:
                return FinishReason("stop", matched=token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason("stop", matched=token)
            matched = self._stop_string(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason("length")
        if req.known_len >= self.max_context_len:
            return FinishReason("length", message="reached the model's context length")
        return None

    def _stop_string(self, req: Req) -> str | None:
        stops = req.sampling_params.stop
        if not stops:
            return None
        # A token decodes to at least one character or is part of one (byte-level BPE), so the last
        # len(longest stop)+2 tokens cover any stop string that the newest token can complete.
        window = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        for stop in stops:
            if stop in tail:
                return stop
        return None


def make_token_out(req: Req, finished: bool) -> TokenOut:
    p = req.sampling_params
    out = TokenOut(
        rid=req.rid,
        new_token_ids=req.output_ids[req.sent_len :],
        finished=req.finished_reason if finished else None,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens or 0,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        stop=p.stop,
        no_stop_trim=p.no_stop_trim,
        spec_verify_ct=req.spec_verify_ct,
    )
    if finished:
        out.embedding = req.embedding
        out.timings = [req.queued_at, req.scheduled_at, req.first_token_at, time.perf_counter()]
    if req.options.return_logprob:
        out.output_token_logprobs, req.pending_logprobs = req.pending_logprobs, []
        out.output_top_logprobs, req.pending_top_logprobs = req.pending_top_logprobs, []
        if req.input_logprobs is not None and not req.input_logprobs_sent:
            out.input_token_ids = req.input_logprobs["ids"]
            out.input_token_logprobs = req.input_logprobs["values"]
            out.input_top_logprobs = req.input_logprobs["tops"]
            req.input_logprobs_sent = True
    req.sent_len = len(req.output_ids)
    req.steps_since_send = 0
    return out
