"""Built-in chat templates plugin: registers the named templates of `builtin.py`.

Loaded in every rxf process, so importing it stays cheap: the templates are imported when the hook
runs, and transformers/jinja2 only when a template that needs them renders.
"""

from __future__ import annotations

import logging

from rxf.core.hookspecs import RegisterChatTemplate, hookimpl

logger = logging.getLogger(__name__)


@hookimpl
def rxf_register_chat_templates(register: RegisterChatTemplate) -> None:
    from rxf.plugins.chat_templates.builtin import BUILTIN_TEMPLATES

    for template in BUILTIN_TEMPLATES:
        register(template)
