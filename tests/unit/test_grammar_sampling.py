"""The grammar bitmask inside the batched sampler, and the xgrammar backend's compile cache.

Reference: the allowed sets are random boolean masks packed here into xgrammar's bit layout; the
expected greedy token is torch's argmax over the allowed logits.
"""

from __future__ import annotations

import pytest
import torch

from rxf.core.config import GrammarConfig
from rxf.core.grammar import GrammarError, LazyGrammarBackend
from rxf.core.runner.sampling import GrammarMask, SamplingBatch, make_generator
from rxf.core.sampling_params import SamplingParams
from rxf.plugins.grammar.xgrammar_backend import XGrammarBackend
from rxf.testing.checkpoints import make_tiny_tokenizer

VOCAB = 512  # the tiny tokenizer's size, which the backend's bitmask covers


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[bs, vocab] bool -> [bs, ceil(vocab / 32)] int32, bit j % 32 of word j // 32 = token j allowed."""
    bs, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(bs, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    bits = (padded.view(bs, words, 32) << torch.arange(32)).sum(-1)
    return bits.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else bits.to(torch.int32)


@pytest.fixture(scope="module")
def backend():
    backend = XGrammarBackend(make_tiny_tokenizer(VOCAB), VOCAB, GrammarConfig(cache_size=2))
    yield backend
    backend.close()


PARAMS = [
    {"temperature": 0.0},
    {"temperature": 1.3, "top_k": 5, "seed": 1},
    {"temperature": 0.7, "top_p": 0.5, "seed": 2},
    {"temperature": 1.0, "min_p": 0.3, "repetition_penalty": 1.5, "seed": 3},
    {"temperature": 1.0, "logit_bias": {7: 100.0}, "frequency_penalty": 1.0, "seed": 4},
    {"temperature": 0.9, "seed": 5},  # unconstrained
]


def _batch(params, device, mask=None):
    ps = [SamplingParams.from_dict(p) for p in params]
    gens = [make_generator(p.seed, device) if p.seed is not None else None for p in ps]
    return SamplingBatch.build(ps, [[1, 2, 3]] * len(ps), [[7, 8]] * len(ps), gens, VOCAB, device, grammar_mask=mask)


def _check_masked_sampling(backend, device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [0, 1, 2, 3, 4]  # the last row is unconstrained
    for trial in range(30):
        logits = torch.randn(len(PARAMS), VOCAB, generator=gen) * 4
        allowed = torch.rand(len(PARAMS), VOCAB, generator=gen) < 0.05
        allowed[:, trial] = True  # never empty
        allowed[len(rows):] = True
        bitmask = pack(allowed).to(device)
        mask = GrammarMask(bitmask, rows, backend.apply_bitmask)
        out = _batch(PARAMS, device, mask).sample(logits.to(device))
        ids = out.next_token_ids.cpu()
        assert all(allowed[r, ids[r]] for r in rows), (trial, ids)
        assert ids[0] == logits[0].masked_fill(~allowed[0], float("-inf")).argmax()
        # The unconstrained row draws exactly what it draws without any mask in the batch.
        assert ids[-1] == _batch(PARAMS, device).sample(logits.to(device)).next_token_ids.cpu()[-1]
        # Reported logprobs stay the model's (unmasked) distribution.
        assert torch.equal(out.raw_logits.cpu(), logits)


def test_masked_tokens_are_never_sampled_cpu(backend):
    _check_masked_sampling(backend, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masked_tokens_are_never_sampled_gpu(backend):
    _check_masked_sampling(backend, "cuda")


def test_compile_cache_is_lru_bounded_and_errors_are_clean(backend):
    a = backend.compile("regex", "a+")
    assert backend.compile("regex", "a+") is a  # cached
    backend.compile("regex", "b+")
    backend.compile("json_schema", '{"type": "integer"}')  # cache_size 2: "a+" is evicted
    assert backend.compile("regex", "a+") is not a
    with pytest.raises(GrammarError, match=r"^invalid regex: Regex parsing error") as err:
        backend.compile("regex", "(")
    assert "/project/" not in str(err.value)
    with pytest.raises(GrammarError, match=r"^invalid ebnf: .*nope"):
        backend.compile("ebnf", "root ::= nope")


def test_matcher_accepts_rolls_back_and_forces_strings(backend):
    tokenizer = make_tiny_tokenizer(VOCAB)
    m = backend.matcher(backend.compile("regex", r"hello (world|there)"), stop_token_ids=[2])
    assert m.jump_forward_string(64) == "hello "
    assert not m.accept_token(2)  # a stop token only once the grammar is complete
    ids = tokenizer.encode("hello ", add_special_tokens=False)
    assert all(m.accept_token(t) for t in ids) and m.jump_forward_string(64) == ""  # world or there
    bitmask = backend.allocate_bitmask(1)
    m.fill_bitmask(bitmask, 0)
    allowed = {t for t in range(VOCAB) if bitmask[0, t // 32] >> (t % 32) & 1}
    assert allowed and all(("world".startswith(s) or "there".startswith(s)) and s
                           for s in (tokenizer.decode([t]) for t in allowed))
    m.rollback(len(ids))
    assert m.jump_forward_string(64) == "hello "
    for t in tokenizer.encode("hello there", add_special_tokens=False) + [2]:
        assert m.accept_token(t)
    assert m.is_terminated()


def test_lazy_backend_builds_once_on_first_use_and_a_failed_build_rejects_constraints():
    import concurrent.futures

    builds = []

    def build():
        builds.append(1)
        return XGrammarBackend(make_tiny_tokenizer(VOCAB), VOCAB, GrammarConfig())

    lazy = LazyGrammarBackend("xgrammar", build)
    assert builds == []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # concurrent first compiles build once
        compiled = list(pool.map(lambda i: lazy.compile("regex", f"a{{{i + 1}}}"), range(8)))
    assert len(builds) == 1
    matcher = lazy.matcher(compiled[0])
    assert matcher.accept_token(make_tiny_tokenizer(VOCAB).convert_tokens_to_ids("a")) is True

    def broken():
        builds.append(2)
        raise RuntimeError("no tokenizer tables")

    failed = LazyGrammarBackend("xgrammar", broken)
    for _ in range(2):  # the failure is kept: no rebuild per request
        with pytest.raises(GrammarError, match="grammar backend 'xgrammar' failed to start: no tokenizer tables"):
            failed.compile("regex", "a")
    assert builds == [1, 2]
