"""Speculative decoding on the host: the n-gram proposer, acceptance, and the scheduler's
bookkeeping over `FakeRunner` (drafts verified, rejected slots freed, stops inside an accepted span).

The fake model's next token hashes the sequence it reads back through the request's KV row, so a
draft is accepted only when it equals that hash: with a 3-token vocabulary a third of them are,
and an output equals `expected` only if every accepted token's KV and every freed slot were right.
The KV ledger is asserted after every step (`check_memory=True`).
"""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.req import Req
from rxf.core.scheduler.scheduler import Scheduler
from rxf.core.speculative.accept import accepted_tokens
from rxf.core.speculative.ngram import NgramIndex
from rxf.entrypoints.metrics import ServerMetrics
from rxf.testing.fake_runner import FakeRunner, FakeTokenizer, expected, fake_config, run_steps

VOCAB = 3
SPEC = {"speculative": {
    "method": "ngram", "num_draft_tokens": 4, "ngram_min_match": 1, "ngram_max_match": 3, "max_batch_size": 8,
}}


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The proposal by definition: longest suffix first, its latest earlier occurrence."""
    for n in range(hi, lo - 1, -1):
        suffix = tokens[len(tokens) - n :] if len(tokens) >= n else None
        for e in range(len(tokens) - 1, n - 1, -1):
            if suffix is not None and tokens[e - n : e] == suffix:
                return tokens[e : e + k]
    return []


def test_ngram_index_proposes_the_latest_longest_match_incrementally():
    rng = random.Random(0)
    prompt = [rng.randrange(4) for _ in range(30)]
    output: list[int] = []
    index = NgramIndex(1, 3)
    for step in range(60):
        index.sync(prompt, output)
        assert index.propose(5) == brute_force(prompt + output, 5, 1, 3), f"step {step}"
        output += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
    # Jump-forward may replace the newest token: the index reads it again.
    output[-1] = (output[-1] + 1) % 4
    index.sync(prompt, output)
    assert index.propose(5) == brute_force(prompt + output, 5, 1, 3)
    assert NgramIndex(2, 3).propose(4) == []  # nothing indexed: no proposal


def test_accepted_tokens_stop_at_the_first_disagreement():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + the bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the correction replaces the draft
    assert accepted_tokens([], [4]) == [4]
    with pytest.raises(ValueError):
        accepted_tokens([5], [5])


def make(num_slots: int = 512, overlap: bool = False, **config) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(num_slots=num_slots, vocab_size=VOCAB, overlap=overlap)
    return Scheduler(fake_config(**{**SPEC, **config}), runner, FakeTokenizer(), check_memory=True), runner


def request(rid: str, prompt: list[int], max_new: int, **params) -> PreparedRequest:
    sp = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0, **params})
    return PreparedRequest(rid, prompt, sp, RequestOptions(stream=True))


def drain(sched: Scheduler) -> dict[str, dict]:
    got = run_steps(sched, 5000)
    assert not sched.has_work
    return got


def prompts(n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(4, 30))] for i in range(n)}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_drafts_are_verified_and_outputs_match_decoding_without_them(overlap):
    sched, runner = make(overlap=overlap)
    ps = prompts(6, seed=1)
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 40))
    got = drain(sched)
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: expected(p, 40, VOCAB) for rid, p in ps.items()}
    c = sched.spec.counters
    assert c.verify_steps > 0 and 0 < c.accepted_tokens < c.drafted_tokens, c
    # Every decode forward counted once: 40 tokens = 1 from prefill + the decode steps' tokens.
    assert all(r["verify"] < 39 for r in got.values()), got
    assert sum(len(b.input_ids) for b in runner.batches if b.drafts) > 0
    assert runner.max_unresolved == 1 or overlap  # (with overlap, only steps without drafts overlap)
    sched.flush_cache()
    assert sched.kv.free_slots() == runner.token_to_kv_pool.num_slots  # nothing leaked
    metrics = ServerMetrics("m")
    metrics.refresh(sched.stats())
    metrics.refresh(sched.stats())  # a second scrape adds nothing
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples["rxf:spec_draft_tokens_total"] == samples["vllm:spec_decode_num_draft_tokens_total"] == c.drafted_tokens
    assert samples["rxf:spec_accepted_tokens_total"] == c.accepted_tokens
    assert samples["rxf:spec_verify_steps_total"] == c.verify_steps


def test_stops_inside_an_accepted_span_cut_the_output_exactly():
    ps = prompts(6, seed=2)
    plain = [expected(p, 40, VOCAB) for p in ps.values()]
    # A stop string that appears in each output, and a token budget ending mid-span.
    stops = [FakeTokenizer().decode(out[10:12]) for out in plain]
    sched, _ = make()
    for (rid, p), stop in zip(ps.items(), stops, strict=True):
        sched.add_request(request(rid, p, 40, stop=[stop]))
        sched.add_request(request(rid + "-len", p, 13))
    got = drain(sched)
    for rid, out, stop in zip(ps, plain, stops, strict=True):
        n = next(i for i in range(1, 41) if stop in FakeTokenizer().decode(out[:i]))
        assert got[rid]["ids"] == out[:n] and got[rid]["finished"].type == "stop", (rid, out, stop)
        assert got[rid + "-len"]["ids"] == out[:13] and got[rid + "-len"]["finished"].type == "length"


def test_retraction_and_a_tiny_pool_keep_outputs_exact():
    # 8 requests of up to 30 + 60 tokens in 200 slots: decode runs out, retracts, re-admits.
    sched, _ = make(num_slots=200, scheduler={"max_running_requests": 8})
    ps = prompts(8, seed=3)
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 60))
    got = drain(sched)
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: expected(p, 60, VOCAB) for rid, p in ps.items()}
    assert sched.counters.retractions > 0 and sched.spec.counters.accepted_tokens > 0


def test_abort_with_drafts_releases_everything():
    sched, runner = make()
    ps = prompts(3, seed=4)
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 200))
    for _ in range(6):
        sched.step()
    for rid in ps:
        sched.abort(rid)
    drain(sched)
    sched.flush_cache()
    assert sched.kv.free_slots() == runner.token_to_kv_pool.num_slots


def test_no_drafts_above_the_batch_size_limit():
    sched, runner = make(speculative={**SPEC["speculative"], "max_batch_size": 2})
    for rid, p in prompts(4, seed=5).items():
        sched.add_request(request(rid, p, 20))
    drain(sched)
    assert all(sum(map(bool, b.drafts)) <= 2 and len(b.reqs) <= 2 for b in runner.batches if b.drafts)


def test_grammar_masks_every_drafted_position_and_cuts_drafts_it_rejects():
    """Row t of a drafted request's bitmask is the mask after its first t drafts (a fresh matcher
    stepping through them is the reference); drafts stop before the first disallowed one and
    before one that completes the grammar; the matcher is left where it was."""
    from rxf.core.config import GrammarConfig
    from rxf.core.scheduler.constrained import ConstrainedDecoding
    from rxf.core.scheduler.output import StopChecker
    from rxf.plugins.grammar.xgrammar_backend import XGrammarBackend
    from rxf.testing.checkpoints import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(512)
    backend = XGrammarBackend(tokenizer, 512, GrammarConfig())
    try:
        compiled = backend.compile("regex", "ab(c|d)e")
        decoding = ConstrainedDecoding(backend, fake_config(), tokenizer, StopChecker(tokenizer, [], 256))
        ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in "abcde"}
        eos = tokenizer.eos_token_id
        req = Req(request("g", [1, 2], 8), grammar=backend.matcher(compiled, [eos]), grammar_start=0)
        a, b, c, d, e = (ids[ch] for ch in "abcde")
        assert decoding.valid_prefix(req, [a, b, c, e, eos, a]) == 4  # the stop token would complete it: left out
        assert decoding.valid_prefix(req, [a, d]) == 1  # "d" is not allowed after "a"
        drafts = [a, b, c]
        mask = decoding.mask([req], [drafts])
        assert mask.rows == [0, 1, 2, 3]
        reference = backend.matcher(compiled, [eos])
        want = backend.allocate_bitmask(4)
        for t in range(4):
            reference.fill_bitmask(want, t)
            if t < len(drafts):
                assert reference.accept_token(drafts[t])
        assert torch.equal(mask.bitmask, want)
        assert req.grammar.accept_token(a) and not req.grammar.accept_token(c)  # rolled back to the start
    finally:
        backend.close()
