"""The grammar backend interface (structured output) and how the engine picks one.

A backend plugin (`rxf_register_grammar_backends`) registers a factory called as
`factory(tokenizer, vocab_size, config: GrammarConfig)`; it returns a `GrammarBackend`. One backend
lives in the scheduler process (matchers, bitmasks) and one in the process that owns the
TokenizerManager (it compiles each constraint once to reject invalid ones with a 400).
`vocab_size` is the model's logits width (padding included), which the bitmask must cover.

The factory runs on the first use of the backend, not at start-up (`LazyGrammarBackend`): building
a backend's tokenizer tables costs ~150 ms per process on the demo model, wasted when no request is
ever constrained. The first use is always a `compile` (a matcher needs a compiled grammar; the
bitmask is only needed for rows with a matcher), which the scheduler runs on its compile threads,
so the build never stalls the scheduler loop.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rxf.core.sampling_params import GRAMMAR_KINDS as GRAMMAR_KINDS  # re-exported: the grammar API names it

if TYPE_CHECKING:
    from rxf.core.config import EngineConfig
    from rxf.core.registry import PluginRegistry

logger = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A constraint the backend cannot compile; the message is the compiler's reason."""


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used by the scheduler thread only."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a backend-allocated CPU tensor)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""

    @abstractmethod
    def jump_forward_string(self, max_bytes: int) -> str:
        """The text every continuation must start with, at most `max_bytes` UTF-8 bytes of it and
        whole characters only ("" when there is a choice); the matcher's position is unchanged.
        Runs on the scheduler loop for client-sent grammars, whose forced text may be endless
        (`root ::= "a" root`): its time and memory must be bounded by `max_bytes`."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer (thread-safe, cached) and masks logits."""

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """A compiled grammar for `kind` in GRAMMAR_KINDS; raises GrammarError when `text` is invalid.
        The scheduler compiles only constraints that `validate` accepted at the front door."""

    def validate(self, kind: str, text: str) -> None:
        """Raise GrammarError when `text` is invalid or cannot be compiled within the configured
        limits (`grammar.compile_timeout_s`, `grammar.compile_memory_mb`). `text` comes from a
        client: a backend whose compile a constraint can crash or stall must isolate it here (the
        default compiles in this process)."""
        self.compile(kind, text)

    @abstractmethod
    def matcher(self, compiled: Any, stop_token_ids: list[int] | None = None) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar; once the grammar is complete it allows
        `stop_token_ids` (default: the tokenizer's EOS)."""

    @abstractmethod
    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """A CPU bitmask for `batch_size` rows, every token allowed."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, the logits of `rows` that `bitmask` (on logits' device) disallows."""

    def close(self) -> None:  # noqa: B027 - optional: most backends start nothing
        """Release what the backend started (worker processes); called once, when the engine stops."""


class UnavailableGrammarBackend(GrammarBackend):
    """Stands in when no backend is configured or installed: every constraint is rejected with why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def compile(self, kind: str, text: str) -> Any:
        raise GrammarError(self.reason)

    def matcher(self, compiled: Any, stop_token_ids: list[int] | None = None) -> GrammarMatcher:
        raise GrammarError(self.reason)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        raise GrammarError(self.reason)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        raise GrammarError(self.reason)


class LazyGrammarBackend(GrammarBackend):
    """Builds the real backend with `build` on the first call of any method (once, thread-safe).
    A build that fails leaves an `UnavailableGrammarBackend` that rejects constraints with the
    reason, so a broken backend costs constrained requests a clear error, never the server."""

    def __init__(self, name: str, build: Callable[[], GrammarBackend]) -> None:
        self.name = name
        self._build = build
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def _get(self) -> GrammarBackend:
        backend = self._backend
        if backend is None:
            with self._lock:  # concurrent first compiles build once
                if self._backend is None:
                    self._backend = self._build_or_unavailable()
                backend = self._backend
        return backend

    def _build_or_unavailable(self) -> GrammarBackend:
        try:
            return self._build()
        except Exception as exc:
            logger.exception("grammar backend %r failed to start", self.name)
            return UnavailableGrammarBackend(f"grammar backend {self.name!r} failed to start: {exc}")

    def compile(self, kind: str, text: str) -> Any:
        return self._get().compile(kind, text)

    def validate(self, kind: str, text: str) -> None:
        self._get().validate(kind, text)

    def matcher(self, compiled: Any, stop_token_ids: list[int] | None = None) -> GrammarMatcher:
        return self._get().matcher(compiled, stop_token_ids)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return self._get().allocate_bitmask(batch_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        self._get().apply_bitmask(logits, bitmask, rows)

    def close(self) -> None:
        with self._lock:  # never built: nothing to close (and nothing is built now)
            backend = self._backend
        if backend is not None:
            backend.close()


def make_grammar_backend(
    config: EngineConfig, tokenizer: Any, vocab_size: int, registry: PluginRegistry | None = None
) -> GrammarBackend:
    """The configured backend, built on first use (the plugin is imported now, so a broken one fails
    start-up); an `UnavailableGrammarBackend` for "none" (or "auto" with none installed)."""
    from rxf.core.registry import PluginRegistry

    name = config.grammar.backend
    if name == "none":
        return UnavailableGrammarBackend('structured output is off (grammar.backend = "none")')
    if registry is None:
        registry = PluginRegistry.load(config.plugins.allow, config.plugins.deny)
    if name == "auto":
        if "xgrammar" not in registry.names("grammar_backends"):
            return UnavailableGrammarBackend("structured output needs a grammar backend: pip install xgrammar")
        name = "xgrammar"
    factory = registry.get("grammar_backends", name)
    return LazyGrammarBackend(name, lambda: factory(tokenizer, vocab_size, config.grammar))
