"""A model runner without a model, for testing the scheduler on the CPU in milliseconds.

`FakeRunner` implements the scheduler's `StepRunner` protocol over real host-side pools. Its "model"
reads the KV it was given: every forward stores each new token in its slot (the fake K/V), and the
next token of a request is a hash of the tokens it reads back through its `req_to_token` row. So a
request's output equals `expected(prompt, n)` only if the scheduler's bookkeeping is right: the row
lists the slots of exactly its sequence (prefix cache hits, re-pointed rows, retraction and
re-admission), no slot was reused while its KV was still needed, and every pending token of an
overlapped step was named by the right `prev_rows`. It raises at once where the contract breaks.

    runner = FakeRunner(num_slots=256, overlap=True)
    sched = Scheduler(fake_config(), runner, FakeTokenizer(), check_memory=True)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from rxf.core.config import EngineConfig, load_config
from rxf.core.forward import ForwardMode
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.core.runner.step_io import PENDING, StepBatch, StepResult


def next_token(tokens: list[int], vocab_size: int, eos: int | None = None) -> int:
    """The fake model: a hash of the whole sequence (never `eos` unless the sequence asks for it:
    a sequence ending in token 7 is followed by EOS)."""
    if eos is not None and tokens and tokens[-1] == 7:
        return eos
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=4).digest()
    token = int.from_bytes(digest, "little") % vocab_size
    return token if token != eos else (token + 1) % vocab_size


def expected(prompt: list[int], n: int, vocab_size: int, eos: int | None = None) -> list[int]:
    """The fake model's greedy output of `n` tokens (stopping after EOS)."""
    out: list[int] = []
    while len(out) < n:
        out.append(next_token(prompt + out, vocab_size, eos))
        if out[-1] == eos:
            break
    return out


class FakeTokenizer:
    """Token t decodes to one letter; enough for stop strings."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(ord("a") + t): t for t in range(26)}


def run_steps(sched: Any, steps: int, got: dict[str, dict] | None = None) -> dict[str, dict]:
    """Run a `Scheduler` for `steps` steps (or until idle), collecting each request's outputs into
    `got[rid]`: its ids, and the last output's finish reason, cached tokens, timings and
    spec_verify_ct. Raises if a request has output after its finish."""
    got = {} if got is None else got
    for _ in range(steps):
        if not sched.has_work:
            break
        for out in sched.step():
            r = got.setdefault(out.rid, {"ids": [], "finished": None})
            assert r["finished"] is None, f"{out.rid}: output after its finish"
            r["ids"] += out.new_token_ids
            r["finished"], r["cached"], r["timings"] = out.finished, out.cached_tokens, out.timings
            r["verify"] = out.spec_verify_ct
    return got


def fake_config(**overrides: Any) -> EngineConfig:
    base = {"model": {"path": "fake"}, "runtime": {"device": "cpu"}, "grammar": {"backend": "none"}}
    return load_config(base, **overrides)


@dataclass
class _Step:
    batch: StepBatch
    result: StepResult = field(default_factory=StepResult)


class FakeRunner:
    def __init__(
        self,
        num_slots: int = 512,
        max_running: int = 16,
        max_context_len: int = 256,
        vocab_size: int = 50,
        overlap: bool = False,
        eos: int | None = None,
        fail_forward: str | None = None,
    ) -> None:
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.max_total_tokens = num_slots
        self.eos = eos
        self.eos_token_ids = [eos] if eos is not None else []
        self.pooling = None  # a generative model
        self.overlap = overlap
        self.fail_forward = fail_forward  # a forward with a request whose rid contains it fails
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context_len, "cpu")
        self.token_to_kv_pool = TokenToKVPool(num_slots, 0, 1, 1, torch.float32, "cpu")  # no layers
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token): the fake K/V
        self._last_ids: list[int] | None = None
        self._unresolved: list[_Step] = []
        self.batches: list[StepBatch] = []  # every launched batch, for tests to inspect
        self.max_unresolved = 0

    def launch(self, batch: StepBatch) -> _Step:
        self.batches.append(batch)
        step = _Step(batch)
        self._unresolved.append(step)
        self.max_unresolved = max(self.max_unresolved, len(self._unresolved))
        if self.fail_forward is not None and any(self.fail_forward in r.rid for r in batch.reqs):
            step.result.error = RuntimeError("injected forward failure")
            self._last_ids = None
            return step
        table = self.req_to_token_pool.req_to_token
        t, sampled = 0, []
        for i, req in enumerate(batch.reqs):
            row, pre, n = batch.rows[i], batch.prefix_lens[i], batch.extend_lens[i]
            if batch.row_writes[i] is not None:
                start, slots = batch.row_writes[i]
                table[row, start : start + slots.numel()] = slots.to(torch.int32)
            ids = list(batch.input_ids[t : t + n])
            if batch.prev_rows[i] >= 0:
                assert ids[-1] == PENDING and self._last_ids is not None, "a pending token needs the previous step"
                ids[-1] = self._last_ids[batch.prev_rows[i]]
            assert PENDING not in ids, f"request {req.rid}: a placeholder without prev_rows"
            new_slots = batch.out_cache_loc[t : t + n].tolist()
            table[row, pre : pre + n] = torch.tensor(new_slots, dtype=torch.int32)
            for j, (slot, token) in enumerate(zip(new_slots, ids, strict=True)):
                self.kv[slot] = (pre + j, token)
            t += n
            # Read the whole sequence back through the row, as attention would.
            seq = []
            for pos, slot in enumerate(table[row, : pre + n].tolist()):
                where, token = self.kv.get(slot, (None, None))
                assert where == pos, f"request {req.rid}: slot {slot} at position {pos} holds position {where}"
                seq.append(token)
            # A request with drafts samples after its newest token and after each draft.
            n_samples = batch.num_samples(i)
            for k in range(n_samples):
                sampled.append(next_token(seq[: len(seq) - n_samples + 1 + k], self.vocab_size, self.eos))
        assert t == batch.num_tokens == batch.out_cache_loc.numel()
        step.result.next_ids = sampled
        step.result.logprobs = [None] * len(sampled)
        self._last_ids = sampled
        return step

    def resolve(self, step: _Step) -> StepResult:
        assert self._unresolved and self._unresolved[0] is step, "steps resolve in launch order"
        self._unresolved.pop(0)
        return step.result

    @property
    def decode_steps(self) -> int:
        return sum(b.mode in (ForwardMode.DECODE, ForwardMode.MIXED) for b in self.batches)
