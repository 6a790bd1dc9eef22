"""The scheduler over `FakeRunner` (no model, no checkpoint): admission, retraction, chunked and mixed
prefill, priority, abort, stop conditions and overlap scheduling, in milliseconds.

The fake model's next token hashes the whole sequence it reads back through the request's KV row,
so every output is checked against `expected` (the same chain computed directly): a wrong slot, a
reused slot, a wrong pending token or a lost retraction changes the tokens. The KV ledger is
asserted after every step (`check_memory=True`).
"""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import MultimodalItem, PreparedRequest, RequestOptions
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.entrypoints.metrics import ServerMetrics
from rxf.testing.fake_runner import FakeRunner, FakeTokenizer, expected, fake_config, run_steps

VOCAB, EOS = 50, 3


def make(overlap: bool, runner_kw: dict | None = None, **config) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(vocab_size=VOCAB, eos=EOS, overlap=overlap, **(runner_kw or {}))
    return Scheduler(fake_config(**config), runner, FakeTokenizer(), check_memory=True), runner


def request(rid: str, prompt: list[int], max_new: int, **params) -> PreparedRequest:
    sp = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0, **params})
    return PreparedRequest(rid, prompt, sp, RequestOptions(stream=True))


def want(prompt: list[int], n: int) -> list[int]:
    return expected(prompt, n, VOCAB, EOS)


def run(sched: Scheduler, steps: int, got: dict[str, dict] | None = None) -> dict[str, dict]:
    """`steps` steps (or until idle), collecting outputs into `got`."""
    return run_steps(sched, steps, got)


def drain(sched: Scheduler, got: dict[str, dict] | None = None) -> dict[str, dict]:
    got = run(sched, 5000, got)
    assert not sched.has_work, "the scheduler did not finish"
    return got


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> dict[str, list[int]]:
    rng = random.Random(seed)
    # Tokens >= 8: never EOS (3) and never 7, after which the fake model emits EOS.
    return {f"r{i}": [rng.randrange(8, VOCAB) for _ in range(rng.randint(lo, hi))] for i in range(n)}


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request) -> bool:
    return request.param


def test_outputs_match_and_prefixes_are_shared(overlap):
    sched, runner = make(overlap)
    first = prompts(12, seed=0)
    for rid, p in first.items():
        sched.add_request(request(rid, p, 20))
    got = drain(sched)
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: want(p, 20) for rid, p in first.items()}
    assert all(r["finished"].type == ("stop" if r["ids"][-1] == EOS else "length") for r in got.values())
    # A second round on the same prompts plus a token: each hits its cached prefix.
    for rid, p in first.items():
        sched.add_request(request(rid + "b", p + [9], 8))
    got = drain(sched)
    for rid, p in first.items():
        assert got[rid + "b"]["ids"] == want(p + [9], 8)
        assert got[rid + "b"]["cached"] >= len(p)
    assert runner.max_unresolved == (2 if overlap else 1)


def test_eos_inside_an_overlapped_step_is_exact(overlap):
    # Prompts ending in 7 make the fake model emit EOS at once; others run to the length limit.
    sched, runner = make(overlap)
    ps = {"eos": [10, 11, 7], "long": [12, 13, 14], "mid": [15, 16, 17, 18]}
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 30))
    got = drain(sched)
    assert got["eos"]["ids"] == [EOS] and got["eos"]["finished"].type == "stop"
    for rid in ("long", "mid"):
        assert got[rid]["ids"] == want(ps[rid], 30)
    stats = sched.stats()
    assert stats.free_slots + stats.tree_slots == stats.total_slots


def test_requests_ending_by_length_get_no_extra_step(overlap):
    sched, runner = make(overlap)
    sched.add_request(request("a", [10, 11, 12], 5))
    drain(sched)
    # One prefill (samples token 1) and four decodes (tokens 2..5): nothing wasted, overlap or not.
    assert [b.mode for b in runner.batches] == [ForwardMode.EXTEND] + [ForwardMode.DECODE] * 4


def test_retraction_under_a_small_pool_keeps_outputs(overlap):
    sched, runner = make(
        overlap, {"num_slots": 120}, **{"scheduler.init_new_token_ratio": 0.05, "scheduler.min_new_token_ratio": 0.05}
    )
    ps = prompts(8, seed=3, lo=8, hi=20)
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 24))
    got = drain(sched)
    assert sched.counters.retractions > 0
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: want(p, 24) for rid, p in ps.items()}
    # Each finished request's times are in order (a retraction moves none of them back).
    assert all(None not in r["timings"] and r["timings"] == sorted(r["timings"]) for r in got.values())
    # The server's metrics count retractions as vLLM's preemptions.
    metrics = ServerMetrics("m")
    metrics.refresh(sched.stats())
    metrics.refresh(sched.stats())  # a second scrape adds nothing
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert samples["vllm:num_preemptions_total"] == sched.counters.retractions


def test_chunked_prompts_never_outgrow_the_pool_together(overlap):
    """Eight 60-token prompts in chunks of 8 over 100 slots: admission counts each prompt's later
    chunks, so the prompts started can always be finished (counting only the first chunk started
    them all, and the engine stalled once their next chunks found no slot)."""
    sched, runner = make(overlap, {"num_slots": 100}, **{"scheduler.chunked_prefill_size": 8})
    ps = prompts(8, seed=5, lo=60, hi=60)
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 2))
    got = drain(sched)
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: want(p, 2) for rid, p in ps.items()}


def test_the_chunk_size_is_one_steps_budget_and_started_prompts_finish_first(overlap):
    """Four 20-token prompts queued at once, chunk size 16: no step computes more than 16 prompt
    tokens of all of them together, and each prompt is finished before the next one starts (its
    first token comes a step or more before the next one's), where a chunk per prompt per step
    would give every prompt its first token at the same, last, step."""
    sched, runner = make(overlap, **{"scheduler.chunked_prefill_size": 16, "scheduler.mixed_chunked_prefill": False})
    ps = {rid: [8 + i] + p[1:] for i, (rid, p) in enumerate(prompts(4, seed=11, lo=20, hi=20).items())}  # no shared prefix
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 3))
    got = drain(sched)
    assert {rid: r["ids"] for rid, r in got.items()} == {rid: want(p, 3) for rid, p in ps.items()}
    prefills = [b for b in runner.batches if b.mode != ForwardMode.DECODE]
    assert all(sum(b.extend_lens) <= 16 for b in prefills)
    assert sum(sum(b.extend_lens) for b in prefills) == 80  # no prompt token computed twice
    last_chunk = {rid: max(i for i, b in enumerate(prefills) if rid in [r.rid for r in b.reqs]) for rid in ps}
    first_chunk = {rid: min(i for i, b in enumerate(prefills) if rid in [r.rid for r in b.reqs]) for rid in ps}
    order = sorted(ps, key=first_chunk.get)
    assert order == sorted(ps, key=last_chunk.get)
    # A prompt started in a step ends before any prompt started later does (started prompts first).
    assert all(last_chunk[a] <= first_chunk[b] for a, b in zip(order, order[1:], strict=False))


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_chunked_prefill_and_decodes_share_steps_when_mixed(overlap, mixed):
    sched, runner = make(overlap, **{"scheduler.chunked_prefill_size": 8, "scheduler.mixed_chunked_prefill": mixed})
    short = {f"s{i}": [20 + i, 21, 22] for i in range(3)}
    for rid, p in short.items():
        sched.add_request(request(rid, p, 40))
    got = run(sched, 4)
    long_prompt = [8 + (i * 7) % 40 for i in range(60)]  # 60 tokens: 8 chunks of at most 8
    sched.add_request(request("long", long_prompt, 5))
    got = drain(sched, got)
    assert got["long"]["ids"] == want(long_prompt, 5)
    for rid, p in short.items():
        assert got[rid]["ids"] == want(p, 40)
    chunks = [b for b in runner.batches if "long" in [r.rid for r in b.reqs] and b.mode != ForwardMode.DECODE]
    assert len(chunks) == 8 and all(sum(b.extend_lens) - b.extend_lens.count(1) <= 8 for b in chunks)
    with_decodes = [b for b in chunks if any(r.rid.startswith("s") for r in b.reqs)]
    # Mixed: every chunk's forward also decodes the three short requests; separate: none does.
    assert len(with_decodes) == (8 if mixed else 0)
    if mixed:
        assert all(b.mode == ForwardMode.MIXED for b in with_decodes)


def test_priority_orders_admission_and_retraction():
    sched, runner = make(False, {"max_running": 1}, **{"scheduler.policy": "priority"})
    for rid, prio in [("late", 5), ("first", -1), ("mid", 0)]:
        msg = request(rid, [10, 11, 12], 3)
        sched.add_request(msgspec.structs.replace(msg, options=replace(msg.options, priority=prio)))
    drain(sched)
    order = [b.reqs[0].rid for b in runner.batches if b.mode != ForwardMode.DECODE]
    assert order == ["first", "mid", "late"]


def test_abort_mid_stream_releases_its_kv_at_once(overlap):
    sched, runner = make(overlap)
    sched.add_request(request("keep", [10, 11, 12], 30))
    sched.add_request(request("drop", [13, 14, 15], 30))
    got = run(sched, 5)
    sched.abort("drop")
    got = drain(sched, got)
    assert got["drop"]["finished"].type == "abort" and len(got["drop"]["ids"]) < 30
    assert got["keep"]["ids"] == want([10, 11, 12], 30)
    assert all("drop" not in [r.rid for r in b.reqs] for b in runner.batches[-20:])


def test_a_failing_forward_fails_its_batch_only(overlap):
    sched, runner = make(overlap, {"fail_forward": "bad"})
    sched.add_request(request("ok", [10, 11, 12], 6))
    got = run(sched, 3)
    sched.add_request(request("bad", [16, 17, 18], 6))
    got = drain(sched, got)
    assert got["bad"]["finished"].type == "abort" and "internal error" in got["bad"]["finished"].message
    # "ok" shared the failing forward (mixed prefill) and failed with it, or ran on; either way
    # its KV is back and a new request runs as before.
    sched.add_request(request("after", [10, 11, 12], 6))
    sched.add_request(request("retry", [16, 17, 18], 6))  # the failed prompt's KV was never cached
    got = drain(sched)
    assert got["after"]["ids"] == want([10, 11, 12], 6) and got["retry"]["ids"] == want([16, 17, 18], 6)


def test_identical_prompts_prefilled_together_share_the_tree_copy(overlap):
    # Both compute the same prompt in one forward; the second to be cached finds it in the tree,
    # frees its own copy and must read the tree's from then on, while newcomers reuse the freed slots.
    sched, runner = make(overlap, {"num_slots": 100})
    p = [8 + i % 30 for i in range(30)]  # within SHARED_PREFIX_WAIT: "b" is not held back for "a"
    sched.add_request(request("a", p, 12))
    sched.add_request(request("b", p, 12))
    got = run(sched, 2)
    for i in range(4):
        sched.add_request(request(f"new{i}", [20 + i] * 5, 10))
    got = drain(sched, got)
    assert got["a"]["ids"] == got["b"]["ids"] == want(p, 12)
    assert all(got[f"new{i}"]["ids"] == want([20 + i] * 5, 10) for i in range(4))


def test_a_prefix_shared_by_waiting_requests_is_computed_once(overlap):
    """Three 44-token prompts of one 40-token prefix, queued at once, prefilled in steps of 48 prompt
    tokens: the first computes the prefix, the others wait for it to reach the tree and compute
    only their own tails (admitted together, each would compute the prefix too). A request of
    another cache salt shares nothing and does not wait: it takes what is left of the first step."""
    sched, runner = make(overlap, **{"scheduler.chunked_prefill_size": 48})
    prefix = [8 + (i * 7) % 40 for i in range(40)]
    ps = {f"g{i}": prefix + [20 + i, 21, 22, 23] for i in range(3)}
    for rid, p in ps.items():
        sched.add_request(request(rid, p, 6))
    salted = PreparedRequest("salted", ps["g0"], request("x", [9], 6).sampling_params,
                             RequestOptions(stream=True, cache_salt="other"))
    sched.add_request(salted)
    got = drain(sched)
    assert {rid: got[rid]["ids"] for rid in ps} == {rid: want(p, 6) for rid, p in ps.items()}
    assert got["salted"]["ids"] == want(ps["g0"], 6) and got["salted"]["cached"] == 0
    assert sorted(got[rid]["cached"] for rid in ps) == [0, 40, 40]
    first = runner.batches[0]
    assert sorted(r.rid for r in first.reqs) == ["g0", "salted"]  # the followers wait
    prompt_tokens_computed = sum(
        max(0, min(start + n, len(ps[r.rid])) - start)
        for b in runner.batches
        for r, start, n in zip(b.reqs, b.prefix_lens, b.extend_lens, strict=True)
        if r.rid in ps
    )
    assert prompt_tokens_computed == 44 + 4 + 4


def test_an_images_kv_is_shared_only_with_the_same_image(overlap):
    """An image's pad ids are vocabulary ids derived from its hash: a text prompt may spell them and
    another image's may share some. The tree keys the image's positions by its hash, so neither
    reads its KV (before, a text prompt of the same ids got the image's KV as cached tokens, and
    an image sharing the first pad ids took the other's); the same image still hits."""
    sched, _ = make(overlap)
    text, pads = [8 + i for i in range(10)], [30 + i for i in range(8)]
    sp = request("x", [9], 4).sampling_params

    def image_request(rid: str, item_hash: int | None) -> PreparedRequest:
        items = None if item_hash is None else [MultimodalItem("image", item_hash, offset=10, length=8)]
        return PreparedRequest(rid, text + pads + [20], sp, RequestOptions(stream=True), items)

    got = {}
    for rid, item_hash in [("image", 1), ("text", None), ("other image", 2), ("same image", 1)]:
        sched.add_request(image_request(rid, item_hash))
        got = drain(sched, got)
    assert {rid: got[rid]["cached"] for rid in got} == {"image": 0, "text": 10, "other image": 10, "same image": 18}


def test_penalised_requests_never_leave_their_token_in_flight():
    sched, runner = make(True)
    sched.add_request(request("pen", [10, 11, 12], 8, repetition_penalty=1.3))
    sched.add_request(request("free", [13, 14, 15], 8))
    drain(sched)
    for batch in runner.batches:
        for req, prev in zip(batch.reqs, batch.prev_rows, strict=True):
            assert not (req.rid == "pen" and prev >= 0), "a penalised request decoded from an unread token"


def test_stop_strings_end_the_request_in_either_mode(overlap):
    p = [10, 11, 12]
    text = FakeTokenizer().decode(want(p, 30))
    stop = text[12:14]  # two letters the output produces in its 13th and 14th tokens
    sched, _ = make(overlap)
    sched.add_request(request("s", p, 30, stop=[stop]))
    got = drain(sched)
    out = FakeTokenizer().decode(got["s"]["ids"])
    assert got["s"]["finished"].type == "stop" and out.endswith(stop) and stop not in out[:-1]
