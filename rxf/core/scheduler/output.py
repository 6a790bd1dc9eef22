"""After a forward: sample, record logprobs, check stop conditions, and build the outputs to send."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rxf.core.io_struct import FinishReason, TokenOut
from rxf.core.sampling import GrammarMask, SamplingBatch, gather_logprobs, pack_logprobs, unpack_logprobs
from rxf.core.scheduler.req import Req


class StopChecker:
    """Stop conditions: EOS, stop token ids, stop strings, max_new_tokens and the context length."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], max_context_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len

    def banned_ids(self, req: Req) -> list[int]:
        """Tokens that may not be sampled yet because min_new_tokens is not reached."""
        p = req.sampling_params
        if len(req.output_ids) >= p.min_new_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))

    def check(self, req: Req) -> FinishReason | None:
        p = req.sampling_params
        token = req.output_ids[-1]
        if len(req.output_ids) >= p.min_new_tokens:
            if token in p.stop_token_ids:
                return FinishReason("stop", matched=token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason("stop", matched=token)
            matched = self._stop_string(req)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= p.max_new_tokens:
            return FinishReason("length")
        if req.seq_len >= self.max_context_len:
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


@dataclass
class StepLogprobs:
    """One step's output logprobs, already on the host, for the requests (batch rows) that asked."""

    rows: list[int]
    chosen: list[float]
    top: list[list[tuple[int, float]]]


def sample_next(
    reqs: list[Req],
    logits: torch.Tensor,
    stop: StopChecker,
    vocab_size: int,
    grammar_mask: GrammarMask | None = None,
) -> tuple[list[int], StepLogprobs | None]:
    """Sample one token per request from its row of `logits` ([len(reqs), vocab]).

    Exactly one device-to-host transfer: the next token ids, with the logprobs of the requests that
    asked for them packed into the same float64 tensor (ids are exact in float64). When none asked,
    no log_softmax runs at all.
    """
    batch = SamplingBatch.build(
        [r.sampling_params for r in reqs],
        [r.origin_input_ids for r in reqs],
        [r.output_ids for r in reqs],
        [r.generator for r in reqs],
        vocab_size,
        logits.device,
        banned_ids=[stop.banned_ids(r) for r in reqs],
        grammar_mask=grammar_mask,
    )
    out = batch.sample(logits)
    want = [i for i, r in enumerate(reqs) if r.return_logprob]
    if not want:
        return out.next_token_ids.tolist(), None
    top_k = [reqs[i].top_logprobs_num for i in want]
    rows = torch.tensor(want, dtype=torch.int64).to(logits.device, non_blocking=True)
    packed = pack_logprobs(out.logprobs[rows], out.next_token_ids[rows], top_k)
    host = torch.cat([out.next_token_ids.double(), packed.view(-1)]).tolist()
    bs = len(reqs)
    chosen, top = unpack_logprobs(host[bs:], top_k, vocab_size)
    return [int(t) for t in host[:bs]], StepLogprobs(want, chosen, top)


def record_output_logprobs(reqs: list[Req], step: StepLogprobs, next_ids: list[int]) -> None:
    """Appends `sample_next`'s host logprobs to the requests that asked (no device work)."""
    if len(next_ids) != len(reqs):
        raise ValueError("record_output_logprobs: one next token per request")
    for k, i in enumerate(step.rows):
        reqs[i].pending_logprobs.append(step.chosen[k])
        reqs[i].pending_top_logprobs.append(step.top[k])


def record_prompt_logprobs(req: Req, logits: torch.Tensor, abs_start: int) -> None:
    """Logprobs of prompt tokens from the prompt rows of `logits` (row j = position abs_start + j).

    Row j scores the token at position abs_start + j + 1; position 0 has no logprob (None).
    The last row predicts the first output token and is not a prompt logprob.
    """
    prompt = req.origin_input_ids
    first = max(req.logprob_start_len, 0)
    rows = logits[: len(prompt) - 1 - abs_start].float().log_softmax(dim=-1)
    targets = torch.tensor(prompt[abs_start + 1 :], device=logits.device)
    values, tops = gather_logprobs(rows, targets, [req.top_logprobs_num] * len(targets))
    lead = [None] if first == 0 else []
    req.input_logprobs = {
        "ids": prompt[first:],
        "values": lead + values,
        "tops": ([[]] if first == 0 else []) + tops,
    }


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
    )
    if req.return_logprob:
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
