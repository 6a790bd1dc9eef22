"""Child-process plumbing: start `target(*args, ready_conn)` in a fresh interpreter.

Children are started with `python -m rxf.core.launch.child`, not multiprocessing's spawn, because
spawn re-imports the caller's `__main__`: a user script without an `if __name__ == "__main__"`
guard would start a second engine. The target and its arguments arrive pickled on stdin from the
parent (never from the network); the child reports readiness over a Unix socket in the private
IPC directory.
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

_AUTHKEY_ENV = "RXF_CHILD_AUTHKEY"


class ChildProcess:
    """A running child: `name`, `is_alive()`, `exitcode`, `terminate()`, `kill()`, `join()`."""

    def __init__(self, name: str, target: str, args: tuple, ready_path: str) -> None:
        self.name = name
        authkey = os.urandom(16)
        self._listener: Listener | None = Listener(ready_path, family="AF_UNIX", authkey=authkey)
        env = dict(os.environ, **{_AUTHKEY_ENV: authkey.hex()})
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "rxf.core.launch.child", name], stdin=subprocess.PIPE, env=env
        )
        assert self._popen.stdin is not None
        self._popen.stdin.write(pickle.dumps((target, args, ready_path)))
        self._popen.stdin.close()

    def accept_ready(self) -> Connection:
        """The connection the child reports on (blocks until the child has connected)."""
        conn = self._listener.accept()
        self.close_ready_channel()
        return conn

    def close_ready_channel(self) -> None:
        """Stop listening (idempotent); also removes the socket file."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class _ReadyChannel:
    """The ready channel as the target gets it: the cyclic garbage collector is off from the
    child's start until the target's first report on it (ready, or the error it could not start
    with). Start-up imports torch and transformers — millions of long-lived objects that each
    collection pass would walk again, ~20% of a child's start-up CPU on the demo; they are frozen
    (`gc.freeze`: never walked again) when the collector comes back on."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def send(self, msg: Any) -> None:
        if not gc.isenabled():
            gc.freeze()
            gc.enable()
        self._conn.send(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def main() -> None:
    gc.disable()  # until the target reports (see _ReadyChannel)
    # Ctrl-C in a terminal reaches the whole process group; the parent owns shutdown and stops
    # its children with SIGTERM, so a child ignores SIGINT rather than dying mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target, args, ready_path = pickle.loads(sys.stdin.buffer.read())
    conn = Client(ready_path, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV)))
    module, _, attr = target.partition(":")
    fn: Any = getattr(importlib.import_module(module), attr)
    fn(*args, _ReadyChannel(conn))


if __name__ == "__main__":
    main()
