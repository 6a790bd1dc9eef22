"""The Gemma instruction-tuned prompt format as a named rxf chat template (`model.chat_template = "gemma"`).

    <bos><start_of_turn>user
    {content}<end_of_turn>
    <start_of_turn>model
    {content}<end_of_turn>
    ...
    <start_of_turn>model          <- with add_generation_prompt

Gemma has no system role and its turns must alternate user / model (assistant), starting with the
user, so anything else is rejected with a message naming the offending message. Contents are
stripped of surrounding whitespace, as Gemma's published template does.
"""

from __future__ import annotations

from typing import Any

from rxf.core.chat_template import ChatTemplate, text_turns

ROLE_NAMES = {"user": "user", "assistant": "model"}


class GemmaTemplate(ChatTemplate):
    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        parts = ["<bos>"]
        for k, turn in enumerate(text_turns(messages, self)):
            expected = "user" if k % 2 == 0 else "assistant"
            if turn.role != expected:
                raise ValueError(
                    f"messages[{turn.index}]: chat template {self.name!r} needs alternating user/assistant "
                    f"messages starting with user (no system role); got {turn.role!r}"
                )
            parts.append(f"<start_of_turn>{ROLE_NAMES[turn.role]}\n{turn.content.strip()}<end_of_turn>\n")
        if add_generation_prompt:
            parts.append("<start_of_turn>model\n")
        return "".join(parts)


GEMMA_TEMPLATE = GemmaTemplate(name="gemma", stop_strings=("<end_of_turn>",))
