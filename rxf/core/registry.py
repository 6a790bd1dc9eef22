"""The plugin manager facade: loads `rxf` entry points, fills typed registries, explains misses.

rxf's builtins are declared in its own pyproject under `[project.entry-points.rxf]` and load through
exactly this path, like any third-party package's plugins.
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
KINDS = ("attention_backends", "models", "multimodal_processors", "chat_templates", "grammar_backends")


class PluginNotFoundError(KeyError):
    """A name that no loaded plugin registered. The message lists what is available."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


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
        self._items: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}

    # ---- loading ----
    @classmethod
    def load(cls, allow: Iterable[str] | None = None, deny: Iterable[str] = ()) -> PluginRegistry:
        registry = cls(allow, deny)
        registry.load_entry_points()
        return registry

    def load_entry_points(self) -> None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if (self.allow is not None and ep.name not in self.allow) or ep.name in self.deny:
                logger.debug("plugin %s skipped by the allow/deny lists", ep.name)
                continue
            dist = ep.dist
            try:
                module = ep.load()
            except Exception:
                # A broken third-party plugin must not take the engine down with it.
                logger.exception("plugin %s (%s) failed to load", ep.name, dist.name if dist else "?")
                continue
            self.register_plugin(
                module, ep.name, dist.name if dist else "?", dist.version if dist else "?"
            )

    def register_plugin(self, plugin: Any, name: str, distribution: str = "?", version: str = "?") -> None:
        """Add one plugin object/module and collect what its hooks register."""
        if name in self.plugins:
            return  # loading twice is harmless by contract
        self.pm.register(plugin, name=name)
        self.pm.check_pending()  # an implementation that matches no hook is a typo: fail loudly
        info = PluginInfo(name, distribution, version)
        self.plugins[name] = info
        for kind in KINDS:
            hook = getattr(self.pm.hook, f"rxf_register_{kind}")
            for impl in hook.get_hookimpls():
                if impl.plugin_name == name:
                    impl.function(register=self._register_fn(kind, info))

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

    def get(self, kind: str, name: str) -> Any:
        try:
            reg = self._items[kind][name]
        except KeyError:
            available = ", ".join(self.names(kind)) or "none"
            raise PluginNotFoundError(
                f"no {kind.replace('_', ' ')[:-1]} named {name!r}; available: {available}"
            ) from None
        return _resolve(reg.factory)

    def registration(self, kind: str, name: str) -> Registration:
        self.get(kind, name)  # same error message for a miss
        return self._items[kind][name]

    def attention_backend(self, name: str) -> Any:
        return self.get("attention_backends", name)

    def model_class(self, architectures: list[str]) -> Any:
        for arch in architectures:
            if arch in self._items["models"]:
                return self.get("models", arch)
        available = ", ".join(self.names("models")) or "none"
        raise PluginNotFoundError(f"no model registered for architectures {architectures}; available: {available}")

    def chat_template(self, name: str) -> Any:
        return self.get("chat_templates", name)

    def multimodal_processor(self, architecture: str) -> Any | None:
        reg = self._items["multimodal_processors"].get(architecture)
        return None if reg is None else _resolve(reg.factory)
