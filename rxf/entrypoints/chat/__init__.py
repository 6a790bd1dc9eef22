"""A chat request before it reaches the engine, whoever sends it: `Runtime.chat` and the OpenAI
layer's /v1/chat/completions, which only translates its fields to these and their errors to 400s.

- `messages`: OpenAI-shaped messages -> the template's messages, their images and videos, the prompt;
- `tools`: `tools` / `tool_choice` -> what the prompt offers and how each reply is read;
- `tool_parsers`: a model's tool-call formats;
- `prompt`: all of it together -> the native request (rendered text, media) and the parameters it adds.
"""

from __future__ import annotations


class ChatInputError(ValueError):
    """A bad chat input; the message names the field and the reason, `param` is that field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param
