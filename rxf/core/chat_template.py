"""The chat template API: the type a chat-template plugin implements, and the message checks every
template shares (`rxf_register_chat_templates`; the builtins are in `rxf.plugins.chat_templates`).

A `ChatTemplate` renders the whole prompt, special tokens included (BOS too, where the model has
one), so the TokenizerManager tokenizes a rendered prompt with ``add_special_tokens=False`` - the
same contract as Hugging Face templates, which write ``bos_token`` themselves. Named templates
subclass it and format the `Turn`s that `text_turns` gives.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from rxf.core.echo import echo
from rxf.core.tool_syntax import ToolSyntax, inline_tools

ROLES = ("system", "user", "assistant", "tool", "ipython")  # ipython: Llama 3 tool results
# Joins the parts of a list content (text parts and image placeholders) into one string.
PART_SEPARATOR = "\n"


@dataclass(frozen=True, kw_only=True)
class ChatTemplate(ABC):
    """A named prompt format. `stop_strings` end generation on the format's end-of-turn marker
    (for models whose EOS token is something else); `image_placeholder` / `video_placeholder` are
    the text an image / video part renders as (None: the template takes none)."""

    name: str
    stop_strings: tuple[str, ...] = ()
    image_placeholder: str | None = None
    video_placeholder: str | None = None
    # The tool-call format the template's models write (a `model.tool_call_parser` name).
    tool_parser: str | None = None

    @abstractmethod
    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages`; with `add_generation_prompt`, ending where the assistant's
        reply starts. Raises ValueError for messages the template cannot take."""

    def render_with_tools(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        syntax: ToolSyntax,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt for messages that may hold tool calls and results, offering `tools` (OpenAI
        tool entries; may be empty). By default written into plain messages in `syntax`'s text
        form; templates that take tools themselves override this."""
        return self.render(inline_tools(messages, tools, syntax), add_generation_prompt)

    @property
    def source_text(self) -> str:
        """The template's source, where it has one (read to detect its tool-call format)."""
        return ""

    def with_variables(self, variables: Mapping[str, Any]) -> ChatTemplate:
        """This template rendering with extra template variables (a request's
        `chat_template_kwargs`, `reasoning_effort`). A named template formats turns in code and
        reads no variables, so by default it is returned as it is."""
        return self


class Turn(NamedTuple):
    """One validated message, its content flattened to text. `index` is its position in the
    request's messages, for error messages."""

    index: int
    role: str
    content: str


class Media(enum.Enum):
    """A media part of a message's content, in place: its pixels travel separately (preprocessed by
    the multimodal processor), the template only marks where it goes."""

    IMAGE = "image"
    VIDEO = "video"


# Content part types as they reach the template (the server turns OpenAI's image parts into
# "image_url" and video/frame-list parts into "video" before rendering).
_MEDIA_PARTS = {"image_url": Media.IMAGE, "image": Media.IMAGE, "video": Media.VIDEO}


def validated_messages(messages: object) -> list[tuple[int, Mapping[str, Any], list[str | Media]]]:
    """Check roles and content types; return (index, message, parts) where parts are the text
    parts and `Media` markers in order. Errors (ValueError) name the offending message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(
                f"messages[{i}] must be an object with 'role' and 'content', got {type(msg).__name__}"
            )
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {echo(role)}; expected one of {', '.join(ROLES)}")
        out.append((i, msg, _content_parts(i, msg.get("content"))))
    return out


def _content_parts(i: int, content: object) -> list[str | Media]:
    if content is None:  # an assistant turn that only carries tool calls
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(
            f"messages[{i}]: content must be a string or a list of content parts, got {type(content).__name__}"
        )
    parts: list[str | Media] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"messages[{i}].content[{j}]: a text part needs a string 'text'")
            parts.append(text)
        elif kind in _MEDIA_PARTS:
            parts.append(_MEDIA_PARTS[kind])
        else:
            raise ValueError(
                f"messages[{i}].content[{j}]: unsupported content part {kind!r}; "
                "expected 'text', 'image_url' or 'video'"
            )
    return parts


def text_turns(messages: list[dict[str, Any]], template: ChatTemplate) -> list[Turn]:
    """Validated turns for a template that formats plain text; image and video parts become the
    template's placeholders (an error if it has none)."""
    placeholders = {Media.IMAGE: template.image_placeholder, Media.VIDEO: template.video_placeholder}
    turns = []
    for i, msg, parts in validated_messages(messages):
        for p in parts:
            if isinstance(p, Media) and placeholders[p] is None:
                raise ValueError(f"messages[{i}]: chat template {template.name!r} does not take {p.value}s")
        text = PART_SEPARATOR.join(placeholders[p] if isinstance(p, Media) else p for p in parts)
        turns.append(Turn(i, msg["role"], text))
    return turns
