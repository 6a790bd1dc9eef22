"""Built-in chat templates plugin: registers the named templates of `builtin.py`, and the chat
formats models write in - tool-call formats and reasoning parsers - as lazy "module:Class" strings.

A tool-call format is its parser class, which also carries the syntax (`tools.py`) that writes
tools into a prompt in the same format; the parser classes live beside their shared machinery in
`rxf.entrypoints.chat.tool_parsers` and `rxf.entrypoints.chat.reasoning`.

Loaded in every rxf process, so importing it stays cheap: the templates are imported when the hook
runs, and transformers/jinja2 only when a template that needs them renders; the parsers only when
a server picks one.
"""

from __future__ import annotations

import logging

from rxf.core.hookspecs import RegisterChatTemplate, RegisterFactory, hookimpl

logger = logging.getLogger(__name__)

_TOOLS = "rxf.entrypoints.chat.tool_parsers"
_REASONING = "rxf.entrypoints.chat.reasoning"
TOOL_CALL_FORMATS = {
    "hermes": f"{_TOOLS}.hermes:HermesParser",
    "llama3_json": f"{_TOOLS}.llama3_json:Llama3JsonParser",
    "mistral": f"{_TOOLS}.mistral:MistralParser",
    "qwen3_coder": f"{_TOOLS}.qwen3_coder:Qwen3CoderParser",
    "pythonic": f"{_TOOLS}.pythonic:PythonicParser",
    "deepseek_v3": f"{_TOOLS}.deepseek_v3:DeepSeekV3Parser",
    "harmony": f"{_TOOLS}.harmony:HarmonyToolParser",
}
REASONING_PARSERS = {
    "think": f"{_REASONING}.think:ThinkParser",
    "qwen3": f"{_REASONING}.think:ThinkParser",
    "deepseek_r1": f"{_REASONING}.think:ThinkParser",
    "harmony": f"{_REASONING}.harmony:HarmonyReasoningParser",
}


@hookimpl
def rxf_register_chat_templates(register: RegisterChatTemplate) -> None:
    from rxf.plugins.chat_templates.builtin import BUILTIN_TEMPLATES

    for template in BUILTIN_TEMPLATES:
        register(template)


@hookimpl
def rxf_register_tool_call_formats(register: RegisterFactory) -> None:
    for name, factory in TOOL_CALL_FORMATS.items():
        register(name, factory)


@hookimpl
def rxf_register_reasoning_parsers(register: RegisterFactory) -> None:
    for name, factory in REASONING_PARSERS.items():
        register(name, factory)
