"""SamplingParams parsing/validation and the batched sampler, each checked against an independent
computation."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from rxf.core.runner.sampling import (
    SampleOutput,
    SamplingBatch,
    gather_logprobs,
    make_generator,
)
from rxf.core.sampling_params import SamplingParams, fit_max_new_tokens

CPU = torch.device("cpu")


def _build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab,
        CPU,
        banned_ids=banned,
    )


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


# ---------------------------------------------------------------- SamplingParams


def test_defaults_and_pickle() -> None:
    p = SamplingParams.from_dict(None)
    assert p == SamplingParams.from_dict({}) == SamplingParams()
    assert (p.max_new_tokens, p.top_k, p.stop, p.stop_token_ids, p.seed) == (128, -1, [], [], None)
    assert pickle.loads(pickle.dumps(p)) == p


def test_from_dict_coerces() -> None:
    p = SamplingParams.from_dict({"stop": "###", "stop_token_ids": [2, 7], "temperature": 0, "seed": 3})
    assert p.stop == ["###"] and p.stop_token_ids == [2, 7] and p.seed == 3
    assert isinstance(p.temperature, float) and p.is_greedy
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ["a", "b"]
    assert SamplingParams(top_k=1).is_greedy and not SamplingParams().is_greedy


@pytest.mark.parametrize(
    ("d", "field_name"),
    [
        ({"foo": 1}, "'foo'"),
        ({"max_new_tokens": "abc"}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"stop_token_ids": [1, "x"]}, "stop_token_ids"),
        ({"seed": 1.0}, "seed"),
        # verify()
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_fields_name_the_field(d: dict, field_name: str) -> None:
    with pytest.raises(ValueError, match=f"sampling_params(\\.|: unknown field ){field_name}"):
        SamplingParams.from_dict(d)


def test_one_max_new_tokens_rule() -> None:
    assert fit_max_new_tokens(None, 128, prompt_len=10, context_len=100, param="p") == 90  # the default, cut
    assert fit_max_new_tokens(None, None, prompt_len=10, context_len=100, param="p") == 90  # the whole room
    assert fit_max_new_tokens(None, 16, prompt_len=10, context_len=100, param="p") == 16
    assert fit_max_new_tokens(90, 128, prompt_len=10, context_len=100, param="p") == 90
    with pytest.raises(ValueError, match=r"^p: .*context length 100 \(at most 90 new tokens fit\)"):
        fit_max_new_tokens(91, 128, prompt_len=10, context_len=100, param="p")


def test_verify_with_vocab() -> None:
    p = SamplingParams(stop_token_ids=[5, 10])
    p.verify()
    p.verify(vocab_size=11)
    with pytest.raises(ValueError, match="stop_token_ids"):
        p.verify(vocab_size=10)


# ---------------------------------------------------------------- sampler


def test_top_k_1_equals_greedy_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    expected = logits.argmax(dim=-1)
    greedy = _build([SamplingParams(temperature=0.0)] * 6, 50).sample(logits)
    top1 = _build([SamplingParams(top_k=1, temperature=1.0)] * 6, 50).sample(logits)
    mixed = _build([SamplingParams(top_k=1), SamplingParams(temperature=0.0), SamplingParams()] * 2, 50)
    out = mixed.sample(logits)
    assert torch.equal(greedy.next_token_ids, expected)
    assert torch.equal(top1.next_token_ids, expected)
    assert torch.equal(out.next_token_ids[[0, 1, 3, 4]], expected[[0, 1, 3, 4]])
    assert out.next_token_ids.dtype == torch.int64 and out.next_token_ids.shape == (6,)


def _seeded_run(
    target: SamplingParams, row: int, others: list[SamplingParams], logits: torch.Tensor, steps: int
) -> list[int]:
    """Decodes `steps` tokens for one seeded request placed at `row` among unseeded neighbours."""
    assert target.seed is not None
    params = others[:row] + [target] + others[row:]
    gens: list[torch.Generator | None] = [None] * len(params)
    gens[row] = make_generator(target.seed, CPU)
    vocab = logits.shape[-1]
    batch_logits = torch.randn(len(params), vocab)  # neighbours see other logits
    batch_logits[row] = logits
    tokens: list[int] = []
    for _ in range(steps):
        outputs: list[list[int]] = [[7] for _ in params]
        outputs[row] = list(tokens)
        out = _build(params, vocab, outputs=outputs, generators=gens).sample(batch_logits)
        tokens.append(int(out.next_token_ids[row]))
    return tokens


@pytest.mark.parametrize(
    "target",
    [SamplingParams(temperature=0.9, seed=1234), SamplingParams(temperature=0.9, top_p=0.95, seed=1234)],
)
def test_seed_reproducible_across_batches_and_rows(target: SamplingParams) -> None:
    torch.manual_seed(1)
    logits = torch.randn(64) * 0.3  # flat-ish
    # batch_a needs no sort and no penalties; batch_b needs both.
    batch_a = [SamplingParams(temperature=0.0), SamplingParams()]
    batch_b = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(),
        SamplingParams(top_p=0.5, top_k=10),
    ]
    first = _seeded_run(target, 0, batch_a, logits, 30)
    torch.manual_seed(99)  # the global RNG must not matter for a seeded row
    again = _seeded_run(target, 3, batch_b, logits, 30)
    other = _seeded_run(replace(target, seed=4321), 0, batch_a, logits, 30)
    assert first == again
    assert first != other and len(set(first)) > 10


def test_frequencies_match_softmax_with_temperature() -> None:
    torch.manual_seed(2)
    n, temperature = 20_000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    batch = _build([SamplingParams(temperature=temperature)] * n, 5)
    tokens = batch.sample(logits.expand(n, 5)).next_token_ids
    expected = torch.softmax(logits.double() / temperature, dim=-1) * n
    chi2 = float((((_counts(tokens, 5) - expected) ** 2) / expected).sum())
    assert chi2 < 25.0, chi2  # 4 degrees of freedom: p(chi2 > 25) ~ 5e-5


def test_seeded_frequencies_match_softmax() -> None:
    logits = torch.tensor([0.2, -1.0, 1.0, 0.0])
    gen = make_generator(7, CPU)
    batch = _build([SamplingParams(seed=7)], 4, generators=[gen])
    tokens = torch.cat([batch.sample(logits.view(1, 4)).next_token_ids for _ in range(4000)])
    expected = torch.softmax(logits.double(), dim=-1) * 4000
    chi2 = float((((_counts(tokens, 4) - expected) ** 2) / expected).sum())
    assert chi2 < 22.0, chi2  # 3 degrees of freedom


def _kept_support(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Reference filter: plain sequential Python over a sorted list, renormalising after each stage."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k > 0:
        ranked = ranked[:top_k]
    total = sum(probs[i] for i in ranked)
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += probs[i] / total
        if mass >= top_p:
            break
    top = probs[kept[0]]
    return {i for i in kept if probs[i] >= min_p * top}


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(3, 1.0, 0.0), (0, 0.6, 0.0), (-1, 1.0, 0.3), (4, 0.7, 0.0), (5, 0.9, 0.25)],
)
def test_filters_sample_exactly_the_kept_support(top_k: int, top_p: float, min_p: float) -> None:
    torch.manual_seed(3)
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, -0.2, -1.0])
    kept = _kept_support(logits, 0.8, top_k, top_p, min_p)
    assert 1 < len(kept) < 8
    n = 4000
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p)
    # Neutral neighbour rows ensure the filters are applied per row.
    batch = _build([params] * n + [SamplingParams(temperature=0.8)] * 200, 8)
    tokens = batch.sample(logits.expand(n + 200, 8)).next_token_ids
    assert set(tokens[:n].tolist()) == kept
    assert set(tokens[n:].tolist()) == set(range(8))


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_top_p_too_small_for_float32_keeps_the_top_token(top_p: float) -> None:
    """A valid top_p (> 0) that rounds to 0 in float32 samples the top token, as any tiny top_p
    does (it sampled token 0, whatever the logits, before the top token was kept by rule)."""
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0], [2.0, 0.0, 5.0, 1.0]])
    out = _build([SamplingParams(temperature=1.0, top_p=top_p)] * 2, 4).sample(logits)
    assert out.next_token_ids.tolist() == [1, 2]


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(4)
    vocab = 40
    logits = torch.randn(3, vocab) * 3
    prompts = [[1, 2, 3, 3], [5, 6], [7]]
    outputs = [[4, 1], [], [8, 9, 9]]
    penalties = [1.3, 0.7, 1.0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in penalties]
    penalized = _build(params, vocab, prompts, outputs).penalties.apply(logits)  # type: ignore[union-attr]
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(penalty=r)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(penalized[i : i + 1], ref, rtol=0, atol=0)
    # The greedy token is the argmax of the penalised logits.
    out = _build(params, vocab, prompts, outputs).sample(logits)
    assert torch.equal(out.next_token_ids, penalized.argmax(dim=-1))


def test_frequency_presence_penalties_match_loop() -> None:
    torch.manual_seed(5)
    vocab = 30
    logits = torch.randn(3, vocab)
    prompts = [[0, 1, 2], [3], [4]]  # prompt tokens are not penalised by these two
    outputs = [[5, 5, 5, 6], [7, 8, 7], [9, 9]]
    coeffs = [(0.5, 0.25), (-0.4, 1.5), (0.0, 0.0)]
    params = [SamplingParams(frequency_penalty=f, presence_penalty=p) for f, p in coeffs]
    penalized = _build(params, vocab, prompts, outputs).penalties.apply(logits)  # type: ignore[union-attr]
    expected = logits.double().clone()
    for i, (f, p) in enumerate(coeffs):
        for token in set(outputs[i]):
            expected[i, token] -= f * outputs[i].count(token) + p
    torch.testing.assert_close(penalized.double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(penalized[2], logits[2])  # neutral row untouched, bit for bit


def test_no_penalty_state_when_neutral() -> None:
    batch = _build([SamplingParams(), SamplingParams(temperature=0.5)], 10, outputs=[[1, 2], [3]])
    assert batch.penalties is None and batch.top_ks is None and batch.top_ps is None and batch.min_ps is None


def test_banned_ids_never_sampled_and_logprobs_are_raw() -> None:
    torch.manual_seed(6)
    n, vocab = 500, 6
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0, 0.0, 0.0]).expand(n, vocab).clone()
    params = [SamplingParams(temperature=2.0, repetition_penalty=1.5)] * (n - 1) + [
        SamplingParams(temperature=0.0)
    ]
    banned = [[0, 1]] * n
    out = _build(params, vocab, outputs=[[2]] * n, banned=banned).sample(logits.to(torch.bfloat16))
    assert not set(out.next_token_ids.tolist()) & {0, 1}
    assert set(out.next_token_ids[: n - 1].tolist()) == {2, 3, 4, 5}
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1))


def test_gather_logprobs() -> None:
    logprobs = torch.log_softmax(
        torch.tensor([[0.1, 3.0, 2.0, -1.0], [1.0, 0.0, 4.0, 2.5], [0.0, 0.0, 0.5, 1.0]]), -1
    )
    chosen, top = gather_logprobs(logprobs, torch.tensor([3, 2, 0]), [2, 0, 9])
    assert chosen == pytest.approx([logprobs[0, 3].item(), logprobs[1, 2].item(), logprobs[2, 0].item()])
    assert [t for t, _ in top[0]] == [1, 2] and top[1] == []
    assert [t for t, _ in top[2]] == [3, 2, 0, 1] or [t for t, _ in top[2]] == [3, 2, 1, 0]
    for row, alternatives in zip(logprobs, top, strict=True):
        for token, value in alternatives:
            assert value == pytest.approx(row[token].item())
    assert gather_logprobs(logprobs, torch.tensor([0, 0, 0]), [0, 0, 0])[1] == [[], [], []]


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(ValueError, match="logits shape"):
        _build([SamplingParams()], 10).sample(torch.zeros(2, 10))
    assert isinstance(_build([], 10).sample(torch.zeros(0, 10)), SampleOutput)


def test_non_contiguous_logits_match_contiguous() -> None:
    torch.manual_seed(8)
    padded = torch.randn(10, 3).t()  # [3, 10], column-major
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5)] * 3
    batch = _build(params, 10, prompts=[[1, 2]] * 3, outputs=[[3]] * 3, banned=[[4]] * 3)
    assert torch.equal(batch.sample(padded).next_token_ids, batch.sample(padded.contiguous()).next_token_ids)
    expected = batch.penalties.apply(padded.contiguous())  # type: ignore[union-attr]
    assert torch.equal(batch.sample(padded).next_token_ids, expected.argmax(dim=-1))


def test_logit_bias_is_added_after_penalties_and_validated():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [1.0, 2.0, 3.0, 0.5]])
    params = [
        SamplingParams.from_dict({"temperature": 0, "logit_bias": {"0": 5.0, 2: -100}}),
        SamplingParams.from_dict({"temperature": 0}),
    ]
    batch = SamplingBatch.build(params, [[], []], [[], []], [None, None], 4, "cpu")
    assert batch.sample(logits).next_token_ids.tolist() == [0, 2]  # 1+5 beats 2; row 1 untouched
    assert batch.penalties is not None
    expected = logits.clone()
    expected[0, 0] += 5.0
    expected[0, 2] -= 100
    torch.testing.assert_close(batch.penalties.apply(logits), expected)
    for bad in ({"x": 1}, {"1": 101}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams.from_dict({"logit_bias": bad})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"9": 1}}).verify(vocab_size=4)
