"""Our Llama-family models, run through ModelRunner (torch_native, CPU, fp32), against transformers.

Tolerance: `assert_close(ours, hf, rtol=1e-4, atol=1e-4 * max|hf|)`, i.e. 1e-4 relative to the
largest logit (elementwise relative error is meaningless for logits near zero).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rxf.plugins.attention
import rxf.plugins.models
from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.plugins.models.layers.rotary import inverse_frequencies, rope_parameters
from rxf.plugins.models.llama import MistralForCausalLM, Qwen2ForCausalLM
from rxf.testing import make_tiny_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the tiny head_dim spans all three bands
}
VARIANTS = {
    "llama": ("LlamaForCausalLM", {"head_dim": 32, "attention_bias": True, "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
}
PROMPTS = [[5, 80, 17, 300, 42, 9, 250, 11, 64, 3, 77], [400, 12], [99, 100, 101, 102, 103, 104]]


def registry() -> PluginRegistry:
    reg = PluginRegistry()
    reg.register_plugin(rxf.plugins.models, "models")
    reg.register_plugin(rxf.plugins.attention, "attention")
    return reg


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = VARIANTS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=1, **overrides)
    config = load_config(
        None,
        **{
            "attention.backend": "torch_native",
            "runtime.device": "cpu",
            "model.dtype": "float32",
            "cache.max_total_tokens": 2048,
            "scheduler.max_running_requests": 8,
        },
    )
    runner = ModelRunner(config, registry(), str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return runner, hf


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


class Requests:
    """A minimal stand-in for the scheduler: rows, slots and token lists."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool.clear()
        self.runner = runner
        self.tokens = [list(p) for p in prompts]
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        self.slots = [runner.token_to_kv_pool.alloc(len(p)) for p in prompts]

    def prefill(self, logits_start: list[int] | None = None) -> torch.Tensor:
        return self.runner.forward(
            ModelInput(
                ForwardMode.PREFILL,
                self.rows,
                [t for toks in self.tokens for t in toks],
                [0] * len(self.rows),
                [len(t) for t in self.tokens],
                torch.cat(self.slots),
                logits_start=logits_start,
            )
        )

    def decode(self, next_tokens: list[int]) -> torch.Tensor:
        new = self.runner.token_to_kv_pool.alloc(len(next_tokens))
        prefix_lens = [len(t) for t in self.tokens]
        for i, token in enumerate(next_tokens):
            self.tokens[i].append(token)
            self.slots[i] = torch.cat((self.slots[i], new[i : i + 1]))
        return self.runner.forward(
            ModelInput(ForwardMode.DECODE, self.rows, next_tokens, prefix_lens, [1] * len(next_tokens), new)
        )


def test_prefill_logits_match_hf(pair) -> None:
    runner, hf = pair
    reqs = Requests(runner, PROMPTS)
    everything = reqs.prefill(logits_start=[0, 0, 0])  # every prompt position, for prompt logprobs
    expected = [hf_logits(hf, p) for p in PROMPTS]
    assert everything.dtype == torch.float32 and everything.shape == (
        sum(map(len, PROMPTS)),
        runner.vocab_size,
    )
    assert_logits_close(everything, torch.cat(expected))

    reqs = Requests(runner, PROMPTS)
    last = reqs.prefill()  # default: last token of each request
    assert_logits_close(last, torch.stack([e[-1] for e in expected]))

    reqs = Requests(runner, PROMPTS)
    partial = reqs.prefill(logits_start=[8, 1, 5])
    assert_logits_close(partial, torch.cat([expected[0][8:], expected[1][1:], expected[2][5:]]))


def test_decode_and_cached_prefix_extend_match_hf(pair) -> None:
    runner, hf = pair
    reqs = Requests(runner, PROMPTS)
    reqs.prefill()
    for step in range(3):
        logits = reqs.decode([7 + step, 200 + step, 450 - step])
        assert_logits_close(logits, torch.stack([hf_logits(hf, t)[-1] for t in reqs.tokens]))

    # A new request reuses the first request's first 9 KV slots (a radix-cache hit) and computes
    # only its own suffix.
    shared = 9
    suffix = [31, 32, 33, 34]
    row = runner.req_to_token_pool.alloc()
    new_slots = runner.token_to_kv_pool.alloc(len(suffix))
    logits = runner.forward(
        ModelInput(
            ForwardMode.EXTEND,
            [row],
            suffix,
            [shared],
            [len(suffix)],
            new_slots,
            row_writes=[(0, reqs.slots[0][:shared])],
            logits_start=[0],
        )
    )
    full = reqs.tokens[0][:shared] + suffix
    assert_logits_close(logits, hf_logits(hf, full)[shared:])


def test_greedy_generation_matches_hf(pair) -> None:
    runner, hf = pair
    new_tokens = 32
    reqs = Requests(runner, PROMPTS)
    generated: list[list[int]] = [[] for _ in PROMPTS]
    next_tokens = reqs.prefill().argmax(-1).tolist()
    for _ in range(new_tokens - 1):
        for out, token in zip(generated, next_tokens, strict=True):
            out.append(token)
        next_tokens = reqs.decode(next_tokens).argmax(-1).tolist()
    for out, token in zip(generated, next_tokens, strict=True):
        out.append(token)

    eos = set(runner.eos_token_ids)
    for prompt, ours in zip(PROMPTS, generated, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens)[
                0, len(prompt) :
            ]
        # HF stops at an eos token; the engine would too, so compare up to and including it.
        stop = next((i + 1 for i, t in enumerate(ours) if t in eos), len(ours))
        assert ours[:stop] == ref.tolist()


def _layer_windows(model: torch.nn.Module) -> list[int | None]:
    return [layer.self_attn.attn.sliding_window for layer in model.model.layers]


@pytest.mark.parametrize(
    ("model_type", "cls", "fields", "windows"),
    [
        ("mistral", MistralForCausalLM, {"sliding_window": 16}, [16, 16, 16]),
        ("mistral", MistralForCausalLM, {"sliding_window": None}, [None, None, None]),
        ("mistral", MistralForCausalLM, {"sliding_window": 128}, [None, None, None]),  # >= the context
        ("qwen2", Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
         [None, 16, 16]),
        ("qwen2", Qwen2ForCausalLM, {"use_sliding_window": False, "sliding_window": 16}, [None, None, None]),
        ("qwen2", Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 16,
                                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
         [16, None, 16]),
    ],
)
def test_sliding_window_per_layer(model_type: str, cls: type, fields: dict, windows: list[int | None]) -> None:
    """Each layer's window as transformers' model applies it (its config fills `layer_types`)."""
    config = AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, max_position_embeddings=128, **fields,
    )
    assert _layer_windows(cls(config, dtype=torch.float32)) == windows


def test_checkpoint_variants_are_what_the_tests_claim(tmp_path: Path) -> None:
    cfg = AutoConfig.from_pretrained(
        make_tiny_checkpoint(tmp_path / "q", "Qwen2ForCausalLM", tie_word_embeddings=True)
    )
    assert cfg.tie_word_embeddings and cfg.model_type == "qwen2"


def test_rope_parameters_from_legacy_config_fields() -> None:
    legacy = SimpleNamespace(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters(legacy)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 5000.0
    default = inverse_frequencies(16, {"rope_type": "default", "rope_theta": 5000.0})
    torch.testing.assert_close(inverse_frequencies(16, params), default / 2)
    assert rope_parameters(SimpleNamespace(rope_theta=500.0)) == {"rope_type": "default", "rope_theta": 500.0}
