"""Chat templates: OpenAI-style messages -> one prompt string (the type itself, `ChatTemplate`, is
the plugin API's: `rxf.core.chat_template`).

Kinds of template:
- named ones (``builtin.py`` and third-party plugins) subclass `ChatTemplate` and format `Turn`s;
- `HFChatTemplate`: the model tokenizer's own template, rendered by transformers;
- `JinjaChatTemplate`: a Hugging Face style ``.jinja`` file, rendered here with jinja2.
`resolve_chat_template` maps the ``model.chat_template`` setting to one of them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import warnings
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rxf.core import chat_template as api
from rxf.core.chat_template import PART_SEPARATOR, Media, validated_messages
from rxf.core.tool_syntax import ToolSyntax, tool_messages

if TYPE_CHECKING:
    import jinja2

logger = logging.getLogger(__name__)

# Plugin API names documented here until they moved into core: still importable from this module,
# with a DeprecationWarning, as docs/plugins.md's compatibility promise requires.
_MOVED_TO_CORE = ("ChatTemplate", "Turn", "text_turns")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_CORE:
        warnings.warn(
            f"rxf.plugins.chat_templates.base.{name} moved to rxf.core.chat_template.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hf_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated messages for a Hugging Face template: other keys (name, tool_calls, ...) are
    kept; text-only content becomes one string (what text templates expect); content with media
    stays a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` / ``{"type": "video"}``
    parts, the form multimodal HF templates read."""
    out = []
    for _, msg, parts in validated_messages(messages):
        if any(isinstance(p, Media) for p in parts):
            content: Any = [{"type": p.value} if isinstance(p, Media) else {"type": "text", "text": p} for p in parts]
        else:
            content = PART_SEPARATOR.join(p for p in parts if isinstance(p, str))
        out.append({**msg, "content": content})
    return out


# Besides jinja2's TemplateError, what rendering a template may raise for what it was given
# (messages, a request's variables: `{{ n + 1 }}` with n = "x" is a TypeError): the client's
# input, answered with a 400.
_RENDER_ERRORS = (TypeError, ValueError, AttributeError, LookupError, ArithmeticError, RecursionError)


@dataclass(frozen=True, kw_only=True)
class _SourceTemplate(api.ChatTemplate):
    """A jinja-sourced template (the tokenizer's own, or a .jinja file), rendered by `_render`.
    Tools go to the template itself when its source reads them, else into plain messages in the
    parser's syntax (ChatTemplate's default). `variables` reach the template beside the messages
    (checked by the caller not to shadow the ones rendering sets)."""

    variables: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @abstractmethod
    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str: ...

    def with_variables(self, variables: Mapping[str, Any]) -> api.ChatTemplate:
        return dataclasses.replace(self, variables={**self.variables, **variables})

    def render_with_tools(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        syntax: ToolSyntax,
        add_generation_prompt: bool = True,
    ) -> str:
        if not takes_tools(self.source_text):
            return super().render_with_tools(messages, tools, syntax, add_generation_prompt)
        return self._render(tool_messages(hf_messages(messages)), add_generation_prompt, tools=tools or None)


@dataclass(frozen=True)
class HFChatTemplate(_SourceTemplate):
    """The model tokenizer's own chat template. No stop strings: the model's EOS ends its turn."""

    tokenizer: Any = field(compare=False, repr=False)
    name: str = field(default="hf", kw_only=True)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._render(hf_messages(messages), add_generation_prompt)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.variables, **extra
            )
        except (TemplateError, *_RENDER_ERRORS) as exc:  # includes the template's own raise_exception(...)
            raise ValueError(f"chat template {self.name!r}: {exc}") from exc

    @property
    def source_text(self) -> str:
        source = getattr(self.tokenizer, "chat_template", None) or ""
        return "\n".join(source.values()) if isinstance(source, dict) else source



@dataclass(frozen=True)
class JinjaChatTemplate(_SourceTemplate):
    """A Hugging Face style jinja template, rendered as transformers does: sandboxed, with
    ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, the ``raise_exception``
    and ``strftime_now`` helpers and a non-ASCII-escaping ``tojson``. Compiled on construction, so
    a syntax error surfaces at startup."""

    source: str = field(repr=False)
    bos_token: str = ""
    eos_token: str = ""
    name: str = field(default="jinja", kw_only=True)

    def __post_init__(self) -> None:
        _ = self._compiled

    @classmethod
    def from_file(cls, path: str | Path, *, bos_token: str = "", eos_token: str = "") -> JinjaChatTemplate:
        try:
            source = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read chat template file {str(path)!r}: {exc}") from exc
        logger.info("chat template: loaded %s", path)
        return cls(source, bos_token=bos_token, eos_token=eos_token, name=str(path))

    @property
    def _compiled(self) -> jinja2.Template:
        import jinja2

        try:
            return _compile_jinja(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {self.name!r} is not valid jinja: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._render(hf_messages(messages), add_generation_prompt)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str:
        from jinja2 import TemplateError

        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **self.variables,
                **extra,
            )
        except (TemplateError, *_RENDER_ERRORS) as exc:
            raise ValueError(f"chat template {self.name!r}: {exc}") from exc

    @property
    def source_text(self) -> str:
        return self.source



@functools.lru_cache(maxsize=8)
def _compile_jinja(source: str) -> jinja2.Template:
    """A template's source compiled once (copies with other `variables` share it)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def takes_tools(source: str) -> bool:
    """Whether a jinja chat template reads the tools and tool calls it is given (one that does not
    would silently drop them)."""
    return "tools" in source and "tool_calls" in source


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def resolve_chat_template(
    spec: str | None, tokenizer: Any, registry_lookup: Callable[[str], api.ChatTemplate]
) -> api.ChatTemplate:
    """The template for the ``model.chat_template`` setting: None, "" or "auto" -> the tokenizer's
    own; a path ending in ``.jinja`` -> that file; anything else -> a registered name."""
    if not spec or spec == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the model's tokenizer has no chat template: set model.chat_template to a built-in "
                "name (e.g. 'chatml', 'llama-3') or to a .jinja file"
            )
        return HFChatTemplate(tokenizer)
    if spec.endswith(".jinja"):
        return JinjaChatTemplate.from_file(
            spec,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=getattr(tokenizer, "eos_token", None) or "",
        )
    try:
        return registry_lookup(spec)
    except LookupError as exc:
        reason = exc.args[0] if exc.args else repr(exc)
        raise ValueError(
            f"unknown chat template {spec!r} (model.chat_template takes 'auto', a .jinja file or a "
            f"registered name): {reason}"
        ) from exc
