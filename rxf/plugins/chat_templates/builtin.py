"""Built-in named chat templates. Each renders exactly what its model family's published template
renders (the official Hugging Face jinja templates; FastChat's for Vicuna), BOS included."""

from __future__ import annotations

import logging
from typing import Any

from rxf.core.chat_template import ChatTemplate, Turn, text_turns

logger = logging.getLogger(__name__)


class ChatMLTemplate(ChatTemplate):
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message (Qwen2's template without its
    default system prompt). Any role passes through as written."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        prompt = "".join(f"<|im_start|>{t.role}\n{t.content}<|im_end|>\n" for t in text_turns(messages, self))
        return prompt + "<|im_start|>assistant\n" if add_generation_prompt else prompt


class Llama3Template(ChatTemplate):
    """Meta-Llama-3-Instruct: a header per message and content stripped of surrounding
    whitespace, as the official template's ``| trim`` does."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        prompt = "<|begin_of_text|>" + "".join(
            f"<|start_header_id|>{t.role}<|end_header_id|>\n\n{t.content.strip()}<|eot_id|>"
            for t in text_turns(messages, self)
        )
        return (
            prompt + "<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else prompt
        )


def _system_and_dialog(turns: list[Turn], template: ChatTemplate) -> tuple[str | None, list[Turn]]:
    """Split an optional leading system message from a dialog that must alternate user/assistant,
    starting with the user (the formats below cannot express anything else)."""
    system = None
    if turns[0].role == "system":
        system, turns = turns[0].content, turns[1:]
    if not turns:
        raise ValueError(f"chat template {template.name!r} needs a user message after the system message")
    for k, turn in enumerate(turns):
        expected = "user" if k % 2 == 0 else "assistant"
        if turn.role != expected:
            raise ValueError(
                f"messages[{turn.index}]: chat template {template.name!r} needs a system message (first "
                f"only) then alternating user/assistant messages starting with user; got {turn.role!r}"
            )
    return system, turns


class Llama2Template(ChatTemplate):
    """Llama-2-chat: ``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s>``
    (the system block goes into the first user turn; contents are stripped). The prompt always ends
    where the reply starts, so ``add_generation_prompt`` changes nothing (as in the official
    template)."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        system, dialog = _system_and_dialog(text_turns(messages, self), self)
        parts = []
        for k, turn in enumerate(dialog):
            content = turn.content
            if k == 0 and system is not None:
                content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
            if turn.role == "user":
                parts.append(f"<s>[INST] {content.strip()} [/INST]")
            else:
                parts.append(f" {content.strip()} </s>")
        return "".join(parts)


VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)


class VicunaTemplate(ChatTemplate):
    """Vicuna v1.1 (FastChat ``vicuna_v1.1``): ``{system} USER: {user} ASSISTANT: {assistant}</s>``
    with a default system prompt, and ``<s>`` in front (FastChat leaves BOS to the tokenizer;
    here the rendered prompt carries it, like every template)."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        system, dialog = _system_and_dialog(text_turns(messages, self), self)
        parts = ["<s>", VICUNA_SYSTEM if system is None else system, " "]
        for turn in dialog:
            if turn.role == "user":
                parts.append(f"USER: {turn.content} ")
            else:
                parts.append(f"ASSISTANT: {turn.content}</s>")
        if add_generation_prompt and dialog[-1].role == "user":
            parts.append("ASSISTANT:")
        return "".join(parts)


BUILTIN_TEMPLATES: tuple[ChatTemplate, ...] = (
    ChatMLTemplate(name="chatml", stop_strings=("<|im_end|>",), tool_parser="hermes"),
    Llama2Template(name="llama-2", stop_strings=("</s>",)),
    Llama3Template(name="llama-3", stop_strings=("<|eot_id|>",), tool_parser="llama3_json"),
    VicunaTemplate(name="vicuna", stop_strings=("</s>",)),
)
