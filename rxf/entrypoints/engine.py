"""Start and stop rxf's child processes: the scheduler (+ model runner) and the detokenizer.

They talk over ZMQ `ipc://` sockets in a private (0700) directory that is removed on shutdown.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from rxf.core.config import EngineConfig
from rxf.entrypoints.child import ChildProcess
from rxf.entrypoints.demo_model import resolve_model_path

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    pass


class EngineProcesses:
    """The child processes of one engine and the addresses they listen on."""

    def __init__(self, config: EngineConfig, cancel: threading.Event | None = None) -> None:
        """Start the children and wait until both are ready. Setting `cancel` (from another
        thread) makes a start-up in progress stop its children and raise EngineStartError."""
        self.config = config
        self._cancel = cancel or threading.Event()
        start = time.perf_counter()
        self.model_path = resolve_model_path(config.model.path)
        self.tokenizer_path = config.model.tokenizer_path or self.model_path
        self.ipc_dir = tempfile.mkdtemp(prefix="rxf-ipc-")  # mkdtemp creates it 0700
        self.addrs = {name: f"ipc://{self.ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer")}
        self.procs: list[ChildProcess] = []
        self._closing = False
        try:
            scheduler = self._spawn(
                "rxf-scheduler",
                "rxf.core.scheduler.process:run_scheduler_process",
                (config, self.model_path, self.addrs),
            )
            detokenizer = self._spawn(
                "rxf-detokenizer",
                "rxf.core.detokenizer:run_detokenizer_process",
                (self.tokenizer_path, self.addrs["detokenizer"], self.addrs["tokenizer"]),
            )
            self.info: dict[str, Any] = self._wait_ready(scheduler, "scheduler")
            self._wait_ready(detokenizer, "detokenizer")
        except BaseException:
            self.shutdown()
            raise
        self.info["model_path"] = self.model_path
        self.info["load_time_s"] = round(time.perf_counter() - start, 2)
        logger.info("engine ready in %.1f s: %s", self.info["load_time_s"], self.info)

    def _spawn(self, name: str, target: str, args: tuple) -> ChildProcess:
        proc = ChildProcess(name, target, args, f"{self.ipc_dir}/{name}.ready")
        self.procs.append(proc)
        return proc

    def _wait_ready(self, proc: ChildProcess, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.config.runtime.startup_timeout_s
        conn = self._accept(proc, deadline)
        while not conn.poll(0.2):
            self._check_starting(what, deadline)
        msg = conn.recv()
        if isinstance(msg, dict) and "error" in msg:
            raise EngineStartError(f"{what} failed to start: {msg['error']}")
        return msg if isinstance(msg, dict) else {}

    def _accept(self, proc: ChildProcess, deadline: float) -> Any:
        """Wait for the child to connect its ready channel, noticing if it dies first."""
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(proc.accept_ready()), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            self._check_starting(proc.name, deadline)
        return result[0]

    def _check_starting(self, what: str, deadline: float) -> None:
        """Raise if start-up cannot succeed any more: a child died, time ran out, or cancelled."""
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise EngineStartError(f"{dead[0].name} exited with code {dead[0].exitcode} during start-up")
        if self._cancel.is_set():
            raise EngineStartError("start-up cancelled")
        if time.monotonic() > deadline:
            raise EngineStartError(f"{what} did not start within {self.config.runtime.startup_timeout_s} s")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` from a daemon thread if a child process dies unexpectedly."""

        def run() -> None:
            while not self._closing:
                for p in self.procs:
                    if not p.is_alive() and not self._closing:
                        on_death(f"{p.name} exited unexpectedly (exit code {p.exitcode})")
                        return
                time.sleep(0.2)

        threading.Thread(target=run, name="rxf-watchdog", daemon=True).start()

    def shutdown(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.close_ready_channel()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs.clear()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
