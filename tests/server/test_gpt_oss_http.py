"""gpt-oss behind the HTTP server: native `/generate` (text through the tokenizer, and a batch of
token ids) gives transformers' greedy tokens for a tiny random gpt-oss (sinks, a window of 16 on
alternating layers, yarn, 4 experts / top 2), with chunked prefill at 8."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rxf.testing import make_tiny_checkpoint
from rxf.testing.reference import HFReference

NEW_TOKENS = 24
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("gpt-oss-http"), "GptOssForCausalLM", seed=9, num_hidden_layers=2,
        head_dim=24, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
    )


def test_generate_matches_transformers(server_factory, gpt_oss_dir: Path) -> None:
    server = server_factory({"model.path": str(gpt_oss_dir), "scheduler.chunked_prefill_size": 8})
    ref = HFReference(gpt_oss_dir)
    text = "Serving engines batch many requests together and reuse the cached keys and values of shared prefixes."
    text_ids = AutoTokenizer.from_pretrained(gpt_oss_dir)(text)["input_ids"]
    batch = [list(range(7, 47)), [(11 * i) % 500 + 5 for i in range(60)]]
    assert len(text_ids) > 16, "the prompt must pass the window"
    with server.client() as http:
        by_text = http.post("/generate", json={"text": text, "sampling_params": GREEDY})
        by_ids = http.post("/generate", json={"input_ids": batch, "sampling_params": GREEDY})
    assert by_text.status_code == 200, by_text.text
    assert by_ids.status_code == 200, by_ids.text
    assert by_text.json()["output_ids"] == ref.greedy(text_ids, NEW_TOKENS)
    for out, prompt in zip(by_ids.json(), batch, strict=True):
        assert out["output_ids"] == ref.greedy(prompt, NEW_TOKENS)
