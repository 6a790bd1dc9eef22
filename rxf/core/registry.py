"""The plugin manager facade: loads `rxf` entry points, fills typed registries, explains misses.

rxf's builtins are declared in its own pyproject under `[project.entry-points.rxf]` and load through
exactly this path, like any third-party package's plugins.

Failure policy: a plugin that fails to load (import error, a hook that raises, a hook name with a
typo) is logged with its name and distribution and recorded in `failed`; rxf carries on without it,
unless the configuration asked for it - named in the allow list (`plugins.allow` / `RXF_PLUGINS`),
which raises `PluginLoadError` at once, or by selecting something it would have registered, whose
lookup then fails with a message that names the failed plugin and its error.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from rxf.core import hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rxf"
KINDS = (
    "attention_backends",
    "models",
    "multimodal_processors",
    "chat_templates",
    "grammar_backends",
    "tool_call_formats",
    "reasoning_parsers",
    "quantization_methods",
)


class PluginNotFoundError(KeyError):
    """A name that no loaded plugin registered. The message lists what is available."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class PluginLoadError(ImportError):
    """A plugin the configuration asked for could not be loaded or imported. An ImportError, as
    resolving a lazy factory raised before this type existed."""


@dataclass
class Registration:
    name: str
    factory: Any  # the object, or a lazy "module:attr" string
    plugin: str  # the plugin (entry point) name that registered it
    distribution: str


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    registered: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class PluginFailure:
    name: str
    distribution: str
    version: str
    error: str  # "ExceptionType: message"

    def describe(self) -> str:
        return f"{self.name} ({self.distribution} {self.version}): {self.error}"


def _resolve(factory: Any) -> Any:
    if not isinstance(factory, str):
        return factory
    module, _, attr = factory.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def parse_plugin_filter(spec: str | None) -> tuple[list[str] | None, list[str]]:
    """`RXF_PLUGINS="a,b,-c"`: allow only a and b (when any name is given without "-"), deny c."""
    if not spec:
        return None, []
    names = [n.strip() for n in spec.split(",") if n.strip()]
    allow = [n for n in names if not n.startswith("-")]
    deny = [n[1:] for n in names if n.startswith("-")]
    return (allow or None), deny


class PluginRegistry:
    """Typed lookups over everything the loaded plugins registered."""

    def __init__(self, allow: Iterable[str] | None = None, deny: Iterable[str] = ()) -> None:
        env_allow, env_deny = parse_plugin_filter(os.environ.get("RXF_PLUGINS"))
        allow = list(allow) if allow is not None else env_allow
        self.allow = None if allow is None else set(allow)
        self.deny = set(deny) | set(env_deny)
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.failed: dict[str, PluginFailure] = {}
        self.skipped: list[str] = []  # entry points left out by the allow/deny lists
        self._items: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}

    # ---- loading ----
    @classmethod
    def load(cls, allow: Iterable[str] | None = None, deny: Iterable[str] = ()) -> PluginRegistry:
        registry = cls(allow, deny)
        registry.load_entry_points()
        return registry

    def load_entry_points(self) -> None:
        found: set[str] = set()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            found.add(ep.name)
            if (self.allow is not None and ep.name not in self.allow) or ep.name in self.deny:
                logger.debug("plugin %s skipped by the allow/deny lists", ep.name)
                self.skipped.append(ep.name)
                continue
            dist = ep.dist
            dist_name, version = (dist.name, dist.version) if dist else ("?", "?")
            try:
                self.register_plugin(ep.load(), ep.name, dist_name, version)
            except Exception as e:
                failure = PluginFailure(ep.name, dist_name, version, f"{type(e).__name__}: {e}")
                if self.allow is not None:  # it is in the allow list: the configuration asked for it
                    raise PluginLoadError(
                        f"plugin {failure.describe()}; it is named in plugins.allow / RXF_PLUGINS"
                    ) from e
                # A broken third-party plugin must not take the engine down with it.
                logger.exception("plugin %s (%s %s) failed to load; continuing without it", ep.name, dist_name, version)
                self.failed[ep.name] = failure
        missing = sorted((self.allow or set()) - found)
        if missing:
            raise PluginLoadError(
                f"plugins.allow / RXF_PLUGINS names {', '.join(missing)}, which no installed distribution "
                f"provides; installed plugins: {', '.join(sorted(found)) or 'none'}"
            )

    def register_plugin(self, plugin: Any, name: str, distribution: str = "?", version: str = "?") -> None:
        """Add one plugin object/module and collect what its hooks register.

        All or nothing: if a hook raises, or an implementation matches no hook, the plugin and
        whatever it registered so far are removed again and the error propagates.
        """
        if name in self.plugins:
            return  # loading twice is harmless by contract
        self.pm.register(plugin, name=name)
        info = PluginInfo(name, distribution, version)
        before = {kind: dict(items) for kind, items in self._items.items()}
        try:
            self.pm.check_pending()  # an implementation that matches no hook is a typo: fail loudly
            for kind in KINDS:
                hook = getattr(self.pm.hook, f"rxf_register_{kind}")
                for impl in hook.get_hookimpls():
                    if impl.plugin_name == name:
                        impl.function(register=self._register_fn(kind, info))
        except BaseException:
            self.pm.unregister(name=name)
            self._items = before  # including anything this plugin replaced
            raise
        self.plugins[name] = info

    def _register_fn(self, kind: str, info: PluginInfo) -> Any:
        def register(item_name: Any, factory: Any = None) -> None:
            if kind == "chat_templates" and factory is None:  # register(template)
                item_name, factory = item_name.name, item_name
            if not isinstance(item_name, str) or not item_name:
                raise TypeError(f"plugin {info.name}: {kind} names must be non-empty strings, got {item_name!r}")
            previous = self._items[kind].get(item_name)
            if previous is not None and previous.plugin != info.name:
                logger.info("%s %r from plugin %s replaces the one from %s", kind, item_name, info.name, previous.plugin)
            self._items[kind][item_name] = Registration(item_name, factory, info.name, info.distribution)
            info.registered.setdefault(kind, []).append(item_name)

        return register

    # ---- lookups ----
    def names(self, kind: str) -> list[str]:
        return sorted(self._items[kind])

    def _miss(self, what: str, kind: str, listed_as: str = "available", hint: str = "") -> PluginNotFoundError:
        message = f"{what}; {listed_as}: {', '.join(self.names(kind)) or 'none'}"
        if hint:
            message += f". {hint}"
        if self.failed:
            failures = "; ".join(f.describe() for f in self.failed.values())
            message += f". Plugins that failed to load (one may provide it): {failures}"
        return PluginNotFoundError(message)

    def get(self, kind: str, name: str) -> Any:
        reg = self._items[kind].get(name)
        if reg is None:
            raise self._miss(f"no {kind.replace('_', ' ')[:-1]} named {name!r}", kind)
        try:
            return _resolve(reg.factory)
        except (ImportError, AttributeError) as e:  # a lazy "module:attr" that does not import
            raise PluginLoadError(
                f"{kind.replace('_', ' ')[:-1]} {name!r} from plugin {reg.plugin} ({reg.distribution}) "
                f"could not be imported from {reg.factory!r}: {type(e).__name__}: {e}"
            ) from e

    def registration(self, kind: str, name: str) -> Registration:
        if name not in self._items[kind]:
            raise self._miss(f"no {kind.replace('_', ' ')[:-1]} named {name!r}", kind)
        return self._items[kind][name]

    def attention_backend(self, name: str) -> Any:
        return self.get("attention_backends", name)

    def model_class(self, architectures: list[str]) -> Any:
        for arch in architectures:
            if arch in self._items["models"]:
                return self.get("models", arch)
        shown = ", ".join(repr(a) for a in architectures) or "none (config.json has no `architectures`)"
        example = architectures[0] if architectures else "MyModelForCausalLM"
        raise self._miss(
            f"unknown architecture {shown}: no installed plugin registers it",
            "models",
            listed_as="supported",
            hint=(
                "A plugin adds an architecture in its `rxf_register_models` hook, e.g. "
                f'`register("{example}", "my_package.models:{example}")` (docs/plugins.md); '
                "`rxf plugins` shows what each installed plugin registers"
            ),
        )

    def chat_template(self, name: str) -> Any:
        return self.get("chat_templates", name)

    def multimodal_processor(self, architecture: str) -> Any | None:
        reg = self._items["multimodal_processors"].get(architecture)
        return None if reg is None else self.get("multimodal_processors", architecture)
