"""Compile each new constraint first in a worker process with a memory and a time limit.

Measured on xgrammar 0.2.9 with the demo model's tokenizer: compile time and memory grow with the
constraint, and the body-size limit does not bound them — a 4 MB regex literal, a 400,000-value
enum, a 20,000-property object or an array schema nested 3,000 deep each compiled for more than
60 s, and a 2-value enum of 1 MB strings took 43 s and 700 MB. In the scheduler such a compile holds
a compile thread (every constrained request waits behind it), in the HTTP process an executor
thread; none of it can be interrupted in a thread, and a native crash would end the process.

So the front door (`validate`, before a request is queued) compiles in a worker process: its
address space is limited to
`grammar.compile_memory_mb` over its start-up size, it is killed (and replaced) past
`grammar.compile_timeout_s`, and a worker that dies costs that constraint a GrammarError, nothing
else. Only the verdict comes back: shipping the compiled grammar (`serialize_json`) costs more
than compiling it again (records schema: 9.5 ms to compile, 22 ms to serialize and load back; a
40-property schema 13 ms against 206 ms), so the scheduler compiles it again in its own process,
the same deterministic work now known to fit the limits. The scheduler does not check again in
workers of its own: a verdict that depends on timing could differ between tensor-parallel ranks
(whose admissions must agree, see `rxf.core.scheduler.constrained`), and each rank would pay a
worker's memory (~175 MB unique RSS: it imports xgrammar, hence torch) and start-up (seconds).
Verdicts are cached by the constraint's hash, failures included, so a client repeating a slow
constraint does not hold a worker each time.

Workers are `python -m rxf.plugins.grammar.sandbox` subprocesses, as rxf's engine children are
(`rxf.core.launch.child`), not multiprocessing's spawn: spawn re-imports the caller's `__main__`.
Messages are pickles over the worker's stdin/stdout (from this process only, never the network).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import queue
import resource
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from rxf.core.grammar import GrammarError

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 300.0  # a worker's start (imports xgrammar and torch): seconds on a loaded machine
_UNCHECKED = object()


class _StartFailure(RuntimeError):
    """The worker ended (or hung) before it was ready: no constraint's fault."""


class _Worker:
    """One worker process; `check` runs one compile in it."""

    def __init__(self, init: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rxf.plugins.grammar.sandbox"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.send = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.recv = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.send.send_bytes(init)
        self.ready = False

    def check(self, kind: str, text: str, timeout_s: float) -> str | None:
        """The worker's verdict; TimeoutError past `timeout_s`, EOFError if the worker died."""
        if not self.ready:
            try:
                if not self.recv.poll(_START_TIMEOUT_S):
                    raise EOFError
                self.recv.recv()  # "ready"
            except (EOFError, OSError) as exc:
                raise _StartFailure(f"exit code {self.proc.poll()}") from exc
            self.ready = True
        self.send.send((kind, text))
        if not self.recv.poll(timeout_s):
            raise TimeoutError
        return self.recv.recv()

    def stop(self) -> None:
        self.send.close()  # the worker exits at EOF
        self.recv.close()
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class CompileSandbox:
    """Checks constraints in up to `workers` processes (started on first use); thread-safe."""

    def __init__(self, tokenizer_info: Any, workers: int, timeout_s: float, memory_mb: int, cache_size: int) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.cache_size = cache_size
        self._tokenizer_info = tokenizer_info  # an xgrammar TokenizerInfo, sent to each worker
        self._init: bytes | None = None  # that message, made when a first worker starts
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()  # started workers first
        for _ in range(workers):
            self._idle.put(None)  # a slot whose worker is started when first needed
        self._workers: set[_Worker] = set()
        self._verdicts: OrderedDict[tuple[str, bytes], str | None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, kind: str, text: str) -> None:
        """Raise GrammarError when `text` is invalid or cannot be compiled within the limits."""
        key = (kind, hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
        with self._lock:
            verdict = self._verdicts.get(key, _UNCHECKED)
            if verdict is not _UNCHECKED:
                self._verdicts.move_to_end(key)
        if verdict is _UNCHECKED:
            verdict = self._run(kind, text)
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > self.cache_size:
                    self._verdicts.popitem(last=False)
        if verdict is not None:
            raise GrammarError(verdict)

    def _run(self, kind: str, text: str) -> str | None:
        worker = self._idle.get()  # at most `workers` compiles at once; the others wait here
        try:
            if worker is None:
                try:
                    worker = _Worker(self._init_message())
                except OSError as exc:  # no process to be had (fds, memory)
                    raise _StartFailure(str(exc)) from exc
                with self._lock:
                    self._workers.add(worker)
            verdict = worker.check(kind, text, self.timeout_s)
        except _StartFailure as exc:
            self._discard(worker)
            worker = None
            logger.error("the grammar compile worker failed to start (%s); see its output above", exc)
            # Raised, not returned: no verdict on this constraint is kept, the next one starts a worker.
            raise GrammarError("structured output is unavailable: the grammar compile worker failed to start") from None
        except (TimeoutError, EOFError, OSError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            self._discard(worker)
            worker = None
            logger.warning("a %s constraint of %d characters %s", kind, len(text),
                           f"took over {self.timeout_s:g} s to compile" if timed_out else "ended its compile worker")
            if timed_out:
                return f"{kind} is too complex: compiling it takes over {self.timeout_s:g} s (grammar.compile_timeout_s)"
            return (f"{kind} could not be compiled: the compiler process died on it "
                    f"(it may need over {self.memory_mb} MiB, grammar.compile_memory_mb)")
        finally:
            self._idle.put(worker)
        if verdict == "memory":
            return f"{kind} is too complex: compiling it needs over {self.memory_mb} MiB (grammar.compile_memory_mb)"
        return verdict

    def _init_message(self) -> bytes:
        with self._lock:
            if self._init is None:
                info_json = self._tokenizer_info.serialize_json()
                self._init = pickle.dumps((info_json, self.memory_mb << 20, os.getpid()))
            return self._init

    def _discard(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.proc.kill()
            worker.stop()
            with self._lock:
                self._workers.discard(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, set()
        for worker in workers:
            worker.stop()


# ---- the worker process ----
def _serve() -> None:
    import xgrammar as xgr

    from rxf.plugins.grammar.xgrammar_backend import compile_constraint

    send = Connection(os.dup(1), readable=False)
    recv = Connection(os.dup(0), writable=False)
    os.dup2(2, 1)  # nothing else (a print, native logging) may write to the channel
    tokenizer_info_json, memory_bytes, parent_pid = pickle.loads(recv.recv_bytes())
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1, cache_enabled=False
    )
    if os.path.exists("/proc/self/statm"):  # the limit is over what the worker already maps (torch)
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = mapped + memory_bytes if hard == resource.RLIM_INFINITY else min(mapped + memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    send.send("ready")
    while True:
        try:
            kind, text = recv.recv()
        except EOFError:  # the parent closed the channel (or is gone)
            return
        try:
            verdict = dead_start(compile_constraint(compiler, kind, text), kind)
        except GrammarError as exc:  # xgrammar reports its std::bad_alloc as the reason
            verdict = "memory" if "bad_alloc" in str(exc) else str(exc)
        except MemoryError:
            verdict = "memory"
        send.send(verdict)


def dead_start(compiled: Any, kind: str) -> str | None:
    """Why no output can satisfy a compiled constraint from its start (its first mask allows no token,
    not even a stop: `[^\\s\\S]`, `root ::= root`), else None. A request with one would only fail
    once sampled (`rxf.core.scheduler.constrained`'s dead end); here it is a 400 before it is queued."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return None if bitmask.any() else f"invalid {kind}: no text matches it (it allows no first token)"


def _exit_with_parent(parent_pid: int) -> None:
    # A parent ended by os._exit or SIGKILL closes the channel, but a worker mid-compile would not
    # notice until the compile ends.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


if __name__ == "__main__":
    _serve()
