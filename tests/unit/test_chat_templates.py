"""Chat templates: built-ins against the official templates, HF/.jinja templates, resolution, hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pluggy
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

import rxf.plugins.chat_templates as plugin
from rxf.core import hookspecs
from rxf.core.chat_template import ChatTemplate
from rxf.plugins.chat_templates.base import (
    HFChatTemplate,
    JinjaChatTemplate,
    resolve_chat_template,
)
from rxf.plugins.chat_templates.builtin import BUILTIN_TEMPLATES, ChatMLTemplate

# The chat templates of the official Hugging Face checkpoints (tokenizer_config.json), as the
# reference the built-ins must reproduce.
LLAMA3_OFFICIAL = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN2_DEFAULT_SYSTEM = (
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
)
QWEN2_OFFICIAL = (  # Qwen/Qwen2-7B-Instruct
    "{% for message in messages %}" + QWEN2_DEFAULT_SYSTEM + "{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What chatml must match: Qwen2's template without its default system prompt.
CHATML_REFERENCE = QWEN2_OFFICIAL.replace(QWEN2_DEFAULT_SYSTEM, "")
LLAMA2_OFFICIAL = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

SYS_CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": " Hello. \n"},
    {"role": "user", "content": "  What is 2+2?\nThink.  "},
]
USER_CONV = [{"role": "user", "content": "Hi there!"}]
CONVERSATIONS = [SYS_CONV, USER_CONV, SYS_CONV[1:], SYS_CONV[:2]]

BUILTINS = {t.name: t for t in BUILTIN_TEMPLATES}


def _render_reference(source: str, messages: list[dict[str, Any]], gen: bool, bos: str, eos: str) -> str:
    """Render a template the way transformers does (its jinja environment settings)."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(
        messages=messages, add_generation_prompt=gen, bos_token=bos, eos_token=eos
    )


def test_builtin_exact_strings() -> None:
    conv = SYS_CONV
    assert BUILTINS["chatml"].render(conv) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\n Hello. \n<|im_end|>\n"
        "<|im_start|>user\n  What is 2+2?\nThink.  <|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert BUILTINS["llama-3"].render(conv) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?\nThink.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert BUILTINS["llama-2"].render(conv) == (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there! [/INST] Hello. </s>"
        "<s>[INST] What is 2+2?\nThink. [/INST]"
    )
    assert BUILTINS["vicuna"].render(conv) == (
        "<s>You are terse. USER: Hi there! ASSISTANT:  Hello. \n</s>USER:   What is 2+2?\nThink.   ASSISTANT:"
    )
    assert BUILTINS["vicuna"].render(USER_CONV, add_generation_prompt=False) == (
        "<s>A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions. USER: Hi there! "
    )


def test_builtin_stop_strings() -> None:
    assert {n: t.stop_strings for n, t in BUILTINS.items()} == {
        "chatml": ("<|im_end|>",),
        "llama-2": ("</s>",),
        "llama-3": ("<|eot_id|>",),
        "vicuna": ("</s>",),
    }


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_builtins_match_official_templates(conv: int, gen: bool) -> None:
    messages = CONVERSATIONS[conv]
    assert BUILTINS["llama-3"].render(messages, gen) == _render_reference(
        LLAMA3_OFFICIAL, messages, gen, "<|begin_of_text|>", "<|eot_id|>"
    )
    assert BUILTINS["chatml"].render(messages, gen) == _render_reference(
        CHATML_REFERENCE, messages, gen, "", ""
    )
    if messages[0]["role"] == "system":
        assert BUILTINS["chatml"].render(messages, gen) == _render_reference(
            QWEN2_OFFICIAL, messages, gen, "", ""
        )
    assert BUILTINS["llama-2"].render(messages, gen) == _render_reference(
        LLAMA2_OFFICIAL, messages, gen, "<s>", "</s>"
    )


def test_content_parts_and_images() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert BUILTINS["chatml"].render([{"role": "user", "content": parts}], False) == (
        "<|im_start|>user\nfirst\nsecond<|im_end|>\n"
    )
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    llava = ChatMLTemplate(name="chatml-llava", stop_strings=("<|im_end|>",), image_placeholder="<image>")
    msgs = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    assert llava.render(msgs, False) == "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n"
    with pytest.raises(ValueError, match=r"messages\[0\]: chat template 'chatml' does not take images"):
        BUILTINS["chatml"].render(msgs)
    # An assistant turn with only tool calls has content None.
    assert "assistant\n<|im_end|>" in BUILTINS["chatml"].render(
        [*USER_CONV, {"role": "assistant", "content": None}]
    )


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], r"non-empty list"),
        ([{"role": "bot", "content": "x"}], r"messages\[0\]: unknown role 'bot'"),
        ([*USER_CONV, {"role": "user", "content": 3}], r"messages\[1\]: content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "audio"}]}],
            r"messages\[0\]\.content\[0\]: unsupported content part",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            r"messages\[0\]\.content\[0\]: a text part needs",
        ),
        (["hello"], r"messages\[0\] must be an object"),
    ],
)
def test_bad_messages(messages: list[Any], error: str) -> None:
    for template in BUILTIN_TEMPLATES:
        with pytest.raises(ValueError, match=error):
            template.render(messages)


@pytest.mark.parametrize("name", ["llama-2", "vicuna"])
def test_alternation_required(name: str) -> None:
    template = BUILTINS[name]
    bad = [
        [*USER_CONV, *USER_CONV],
        [{"role": "assistant", "content": "a"}],
        [USER_CONV[0], {"role": "tool", "content": "42"}],
        [USER_CONV[0], {"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}],
    ]
    for messages in bad:
        with pytest.raises(ValueError, match=rf"messages\[\d\]: chat template '{name}' needs"):
            template.render(messages)
    with pytest.raises(ValueError, match="needs a user message after the system message"):
        template.render([{"role": "system", "content": "s"}])


def _tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|eot_id|>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=chat_template,
    )


def _no_lookup(name: str) -> ChatTemplate:
    raise AssertionError(f"unexpected lookup of {name!r}")


def test_hf_template_uses_the_tokenizer_template() -> None:
    tok = _tokenizer(QWEN2_OFFICIAL)
    for spec in (None, "", "auto"):
        template = resolve_chat_template(spec, tok, _no_lookup)
        assert isinstance(template, HFChatTemplate)
        assert template.stop_strings == ()
    for gen in (True, False):
        assert template.render(USER_CONV, gen) == _render_reference(QWEN2_OFFICIAL, USER_CONV, gen, "", "")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(parts, False).endswith("<|im_start|>user\na\nb<|im_end|>\n")
    with pytest.raises(ValueError, match=r"messages\[0\]: unknown role"):
        template.render([{"role": "bot", "content": "x"}])
    # The template's own raise_exception(...) becomes a ValueError (a client error).
    with pytest.raises(ValueError, match="roles must alternate"):
        HFChatTemplate(_tokenizer(LLAMA2_OFFICIAL)).render([*USER_CONV, *USER_CONV])


def test_missing_hf_template_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no chat template: set model.chat_template"):
        resolve_chat_template("auto", _tokenizer(None), _no_lookup)


def test_jinja_file_template(tmp_path: Path) -> None:
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3_OFFICIAL)
    template = resolve_chat_template(str(path), _tokenizer(None), _no_lookup)
    assert isinstance(template, JinjaChatTemplate)
    assert template.name == str(path)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert template.render(messages, gen) == BUILTINS["llama-3"].render(messages, gen)
    with pytest.raises(ValueError, match="cannot read chat template file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"), None, _no_lookup)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="is not valid jinja"):
        resolve_chat_template(str(bad), None, _no_lookup)
    helpers = JinjaChatTemplate(
        "{{ messages | tojson }}{{ raise_exception('no ' + strftime_now('%Y')[:0] + 'way') }}"
    )
    with pytest.raises(ValueError, match="no way"):
        helpers.render(USER_CONV)


def test_registered_names_and_unknown_name() -> None:
    def lookup(name: str) -> ChatTemplate:
        if name not in BUILTINS:
            raise KeyError(f"no chat template {name!r}; available: {', '.join(sorted(BUILTINS))}")
        return BUILTINS[name]

    assert resolve_chat_template("llama-3", None, lookup) is BUILTINS["llama-3"]
    with pytest.raises(
        ValueError, match=r"unknown chat template 'llama-9'.*available: chatml, llama-2, llama-3, vicuna"
    ):
        resolve_chat_template("llama-9", None, lookup)


def test_hook_registers_builtins() -> None:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    registered: list[ChatTemplate] = []
    pm.hook.rxf_register_chat_templates(register=registered.append)
    assert [t.name for t in registered] == ["chatml", "llama-2", "llama-3", "vicuna"]


def test_plugin_import_is_cheap() -> None:
    code = (
        "import sys, rxf.plugins.chat_templates; "
        "assert not {'transformers', 'jinja2', 'torch'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_the_api_types_moved_to_core_still_import_from_the_plugin_with_a_warning() -> None:
    import rxf.core.chat_template as api
    import rxf.plugins.chat_templates.base as old

    for name in ("ChatTemplate", "Turn", "text_turns"):
        with pytest.warns(DeprecationWarning, match=f"moved to rxf.core.chat_template.{name}"):
            assert getattr(old, name) is getattr(api, name)
    with pytest.raises(AttributeError):
        old.NoSuchName  # noqa: B018
