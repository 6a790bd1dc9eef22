"""The whole engine serving Gemma from a config file that names the plugin's architecture (through
the checkpoint), attention backend and chat template; greedy tokens checked against transformers."""

from __future__ import annotations

import pytest

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(rxf_tiny_checkpoint, rxf_runtime, tmp_path_factory):
    path = rxf_tiny_checkpoint("GemmaForCausalLM", seed=3, head_dim=32, tie_word_embeddings=True)
    config = tmp_path_factory.mktemp("config") / "gemma.toml"
    config.write_text(
        f'[model]\npath = "{path}"\ndtype = "float32"\nchat_template = "gemma"\n\n'
        '[attention]\nbackend = "batched_sdpa"\n\n'
        '[runtime]\ndevice = "cpu"\ncpu_threads = 1\n\n'
        "[cache]\nmax_total_tokens = 2048\n"
    )
    return path, rxf_runtime(config=str(config))


def test_greedy_tokens_match_transformers(served, rxf_hf_reference):
    path, rt = served
    assert rt.engine.info["architecture"] == "GemmaForCausalLM"
    assert rt.engine.info["attention_backend"] == "BatchedSDPABackend"
    prompts = ["hello world, this is a test", "the cat"]
    outs = rt.generate(prompts, {"max_new_tokens": 16, **GREEDY})
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == rxf_hf_reference(path).greedy(rt.tokenizer.encode(prompt), 16)


def test_chat_uses_the_plugin_template(served, rxf_hf_reference):
    path, rt = served
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    ids = rt.tokenizer.encode(prompt, add_special_tokens=False)
    out = rt.chat(messages, {"max_new_tokens": 8, **GREEDY})
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["output_ids"] == rxf_hf_reference(path).greedy(ids, 8)
