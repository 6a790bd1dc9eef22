"""The `gemma` template against a jinja rendition of Gemma's format, rendered by transformers."""

from __future__ import annotations

import pytest

from rxf.core.registry import PluginRegistry
from rxf.testing import make_tiny_tokenizer

# Gemma's turn format written as a Hugging Face chat template: an independent second rendition.
GEMMA_JINJA = (
    "{{ '<bos>' }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
DIALOG = [
    {"role": "user", "content": "  What is 2 + 2?\n"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "3 + 3?"}]},
]


@pytest.fixture(scope="module")
def template():
    return PluginRegistry.load().chat_template("gemma")  # by name, through the installed entry point


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_the_jinja_format(template, add_generation_prompt):
    tokenizer = make_tiny_tokenizer()
    hf_dialog = [{**m, "content": m["content"] if isinstance(m["content"], str) else "And\n3 + 3?"} for m in DIALOG]
    expected = tokenizer.apply_chat_template(
        hf_dialog, chat_template=GEMMA_JINJA, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert template.render(DIALOG, add_generation_prompt=add_generation_prompt) == expected
    assert template.stop_strings == ("<end_of_turn>",)


@pytest.mark.parametrize(
    "messages,index",
    [
        ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], 0),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], 1),
    ],
)
def test_rejects_what_gemma_cannot_express(template, messages, index):
    with pytest.raises(ValueError, match=rf"messages\[{index}\].*'gemma'.*alternating"):
        template.render(messages)
