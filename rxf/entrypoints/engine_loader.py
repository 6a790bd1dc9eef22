"""Loading the engine for the HTTP server: the child processes (model load) and, meanwhile, the
tokenizer and chat template in this process.

Nothing heavy is imported at module level (no torch, no transformers, not the server): `rxf launch`
starts an `EngineLoader` first and imports the HTTP server while the children start, so that the
children's own start-up — the critical path of `/health` — begins at once instead of after the
server's imports (about 2.4 s on a 2-core machine, issue 22's start-up bound).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rxf.core.config import EngineConfig

# How long shutdown waits for an interrupted model load to give up (children killed) before exiting.
ABANDON_TIMEOUT_S = 10.0


@dataclass
class Frontend:
    """What the main process loads beside the children."""

    registry: Any  # PluginRegistry
    tokenizer: Any
    chat_template: Any
    tool_parser: Any
    reasoning_parser: Any


@dataclass
class LoadedEngine:
    engine: Any  # EngineProcesses
    frontend: Frontend


def load_engine(config: EngineConfig, cancel: threading.Event) -> LoadedEngine:
    """Blocking: start the child processes (model load) and, meanwhile, load the tokenizer and the
    chat template in this process."""
    from rxf.core.launch.processes import EngineProcesses
    from rxf.entrypoints.demo_model import resolve_model_path

    # Resolved first (it prepares the demo model once) so that the tokenizer can load while the
    # children load the model.
    model_path = resolve_model_path(config.model.path)
    tokenizer_path = config.model.tokenizer_path or model_path
    if not Path(tokenizer_path).is_dir():  # else transformers takes it for a hub repository's name
        raise FileNotFoundError(f"model.tokenizer_path: {tokenizer_path!r} is not a directory (give a tokenizer's directory)")
    with ThreadPoolExecutor(1, thread_name_prefix="rxf-tokenizer-load") as pool:
        frontend = pool.submit(load_frontend, config, tokenizer_path)
        engine = EngineProcesses(config, model_path, cancel=cancel)
        try:
            loaded = LoadedEngine(engine, frontend.result())
        except BaseException:
            engine.shutdown()
            raise
    return loaded


def load_frontend(config: EngineConfig, tokenizer_path: str) -> Frontend:
    """The plugin registry, tokenizer, chat template and the chat output parsers (a bad format name
    fails the launch, not the first chat)."""
    from rxf.core.load_tokenizer import load_tokenizer
    from rxf.core.registry import PluginRegistry
    from rxf.plugins.chat_templates.base import resolve_chat_template

    registry = PluginRegistry.load(config.plugins.allow, config.plugins.deny)
    tokenizer = load_tokenizer(tokenizer_path)
    template = resolve_chat_template(config.model.chat_template, tokenizer, registry.chat_template)
    from rxf.entrypoints.chat.reasoning import make_reasoning_parser
    from rxf.entrypoints.chat.tool_parsers import make_parser

    return Frontend(
        registry, tokenizer, template,
        make_parser(config.model.tool_call_parser, template, tokenizer, registry),
        make_reasoning_parser(config.model.reasoning_parser, template, registry),
    )


class EngineLoader:
    """Runs `load_engine` in a daemon thread from construction; the server's lifespan awaits it
    with `wait()`; `abandon()` stops a load that is still in progress.

    A daemon thread (not the loop's executor, whose threads the interpreter joins at exit), so a
    shutdown during a long load is never stuck behind it. It may start before any event loop exists
    (`rxf launch` starts it before importing the server): the loop that `wait()`s is woken when the
    load ends, or not at all if the load had already ended. The outcome is handed over under a lock
    through `take()`: whoever takes a loaded engine owns it and must shut it down.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.done = threading.Event()
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._outcome: LoadedEngine | BaseException | None = None
        self._finished = False  # under _lock, with _outcome
        self._abandoned = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the waiter's, under _lock
        self._wakeup = asyncio.Event()  # bound to the waiter's loop at its first wait
        threading.Thread(target=self._run, name="rxf-engine-loader", daemon=True).start()

    def _run(self) -> None:
        try:
            outcome: LoadedEngine | BaseException = load_engine(self.config, self.cancel)
        except BaseException as e:
            outcome = e
        with self._lock:
            self._outcome, self._finished = outcome, True
            abandoned, loop = self._abandoned, self._loop
        self.done.set()
        if abandoned:
            self._discard()
            return
        if loop is None:  # nobody waits yet: `wait()` sees `_finished`
            return
        try:
            loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:  # the loop is closed: nobody will take the engine
            self._discard()

    async def wait(self) -> LoadedEngine:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            finished = self._finished
        if not finished:
            await self._wakeup.wait()
        outcome = self.take()
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:
            raise RuntimeError("the engine load was abandoned")
        return outcome

    def take(self) -> LoadedEngine | BaseException | None:
        with self._lock:
            outcome, self._outcome = self._outcome, None
        return outcome

    def _discard(self) -> None:
        outcome = self.take()
        if isinstance(outcome, LoadedEngine):
            outcome.engine.shutdown()

    def abandon(self) -> None:
        """Blocking; idempotent. Make a load in progress fail fast: the engine notices the cancel
        within a poll interval, stops its children and removes its IPC directory. An engine loaded
        but not yet taken is shut down; one already taken is its taker's."""
        with self._lock:
            self._abandoned = True
        self.cancel.set()
        self.done.wait(ABANDON_TIMEOUT_S)
        self._discard()
