"""Start and stop rxf's child processes: the schedulers (+ model runners) and the detokenizer.

They talk over ZMQ `ipc://` sockets in a private (0700) directory that is removed on shutdown.
With `parallel.tp_size` / `dp_size` > 1 there is one scheduler process per tensor-parallel rank of
every data-parallel replica (this node's share of them when the ranks span `nnodes` machines);
only node 0 runs the detokenizer, and only each replica's rank 0 has sockets.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from rxf.core.config import EngineConfig
from rxf.core.ipc.addresses import engine_addrs, replica_addr_key
from rxf.core.launch.child import ChildProcess
from rxf.core.runner.placement import RankPlacement, free_port

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    pass


# The watchdog notices a shutdown within _WATCH_CLOSING_S; without pidfds it polls the children.
_WATCH_CLOSING_S = 0.5
_WATCH_POLL_S = 0.01


def _pidfds(pids: list[int]) -> list[int]:
    """A pidfd per process (readable once it has exited), or [] where the OS has none."""
    fds: list[int] = []
    try:
        for pid in pids:
            fds.append(os.pidfd_open(pid))
    except (AttributeError, OSError):  # not Linux >= 5.3, or a child already reaped
        for fd in fds:
            os.close(fd)
        return []
    return fds


class EngineProcesses:
    """The child processes of one engine and the addresses they listen on."""

    def __init__(self, config: EngineConfig, model_path: str, cancel: threading.Event | None = None) -> None:
        """Start the children on the checkpoint directory `model_path` (`config.model.path` as the
        caller resolved it) and wait until they are ready. Setting `cancel` (from another thread)
        makes a start-up in progress stop its children and raise EngineStartError."""
        self.config = config
        self._cancel = cancel or threading.Event()
        start = time.perf_counter()
        self.model_path = model_path
        self.tokenizer_path = config.model.tokenizer_path or self.model_path
        check_heads_split(config, self.model_path)
        self.ipc_dir = tempfile.mkdtemp(prefix="rxf-ipc-")  # mkdtemp creates it 0700
        self.addrs = engine_addrs(self.ipc_dir, config.parallel.dp_size)
        self.procs: list[ChildProcess] = []
        self._ready_channels: dict[str, tuple[threading.Thread, list[Any]]] = {}
        self._closing = False
        try:
            schedulers = [
                self._spawn(
                    _scheduler_name(placement),
                    "rxf.core.scheduler.process:run_scheduler_process",
                    (config, self.model_path, self._replica_addrs(placement), placement),
                )
                for placement in rank_placements(config)
            ]
            detokenizer = None
            if config.parallel.node_rank == 0:
                detokenizer = self._spawn(
                    "rxf-detokenizer",
                    "rxf.core.detokenizer.process:run_detokenizer_process",
                    (self.tokenizer_path, self.addrs["detokenizer"], self.addrs["tokenizer"]),
                )
            # Every rank must be up (a replica's ranks are ready together: they meet in the
            # process-group rendezvous first); the first replica's rank 0 describes the engine.
            infos = [self._wait_ready(proc, proc.name) for proc in schedulers]
            self.info: dict[str, Any] = infos[0]
            if detokenizer is not None:
                self._wait_ready(detokenizer, "detokenizer")
        except BaseException:
            self.shutdown()
            raise
        self.info["model_path"] = self.model_path
        self.info["load_time_s"] = round(time.perf_counter() - start, 2)
        logger.info("engine ready in %.1f s: %s", self.info["load_time_s"], self.info)

    def _replica_addrs(self, placement: RankPlacement | None) -> dict[str, str]:
        """The addresses one scheduler uses: "scheduler" is its own replica's."""
        dp_rank = 0 if placement is None else placement.dp_rank
        return dict(self.addrs, scheduler=self.addrs[replica_addr_key(dp_rank)])

    def _spawn(self, name: str, target: str, args: tuple) -> ChildProcess:
        proc = ChildProcess(name, target, args, f"{self.ipc_dir}/{name}.ready")
        self.procs.append(proc)
        # Accept its ready channel at once: a child blocks in connecting until it is accepted, and
        # the ranks of a replica start only together (rank 0 waits for the others in the rendezvous).
        result: list[Any] = []

        def accept() -> None:
            try:
                result.append(proc.accept_ready())
            except (OSError, EOFError):  # closed by a shutdown during start-up, or the child died connecting
                pass

        thread = threading.Thread(target=accept, name=f"{name}-ready", daemon=True)
        thread.start()
        self._ready_channels[name] = (thread, result)
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
        thread, result = self._ready_channels[proc.name]
        while thread.is_alive():
            thread.join(0.2)
            self._check_starting(proc.name, deadline)
        if not result:
            raise EngineStartError(f"{proc.name}: its ready channel closed before it connected")
        return result[0]

    def _check_starting(self, what: str, deadline: float) -> None:
        """Raise if start-up cannot succeed any more: a child died, time ran out, or cancelled."""
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            for proc in dead:  # one that reported why it could not start says so
                error = self._reported_error(proc)
                if error is not None:
                    raise EngineStartError(f"{proc.name} failed to start: {error}")
            raise EngineStartError(f"{dead[0].name} exited with code {dead[0].exitcode} during start-up")
        if self._cancel.is_set():
            raise EngineStartError("start-up cancelled")
        if time.monotonic() > deadline:
            raise EngineStartError(f"{what} did not start within {self.config.runtime.startup_timeout_s} s")

    def _reported_error(self, proc: ChildProcess) -> str | None:
        """The error a child sent on its ready channel before exiting, if it sent one."""
        _, result = self._ready_channels.get(proc.name, (None, []))
        try:
            msg = result[0].recv() if result and result[0].poll() else None
        except (EOFError, OSError):
            return None
        return msg["error"] if isinstance(msg, dict) and "error" in msg else None

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(reason)` from a daemon thread as soon as a child process dies unexpectedly:
        the thread sleeps in select() on the children's pidfds, which turn readable when they exit
        (Linux; elsewhere it polls every `_WATCH_POLL_S`)."""
        pidfds = _pidfds([p.pid for p in self.procs])

        def run() -> None:
            try:
                while not self._closing:
                    if pidfds:
                        select.select(pidfds, [], [], _WATCH_CLOSING_S)  # returns at a death
                    else:
                        time.sleep(_WATCH_POLL_S)
                    for p in self.procs:
                        if not p.is_alive() and not self._closing:
                            on_death(f"{p.name} exited unexpectedly (exit code {p.exitcode})")
                            return
            finally:
                for fd in pidfds:
                    os.close(fd)

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


def _scheduler_name(placement: RankPlacement | None) -> str:
    if placement is None:
        return "rxf-scheduler"
    return f"rxf-scheduler-dp{placement.dp_rank}-tp{placement.rank}"


def rank_placements(config: EngineConfig) -> list[RankPlacement | None]:
    """The scheduler processes this node runs: [None] for one rank of one replica, else each
    replica's local ranks, replica after replica. Raises EngineStartError when the GPUs are too few."""
    p = config.parallel
    if p.tp_size == 1 and p.dp_size == 1:
        return [None]
    import torch

    device = config.runtime.device
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    backend = p.dist_backend if p.dist_backend != "auto" else ("nccl" if cuda else "gloo")
    local = p.tp_size // p.nnodes
    if cuda and local * p.dp_size > torch.cuda.device_count():
        raise EngineStartError(
            f"parallel: tp_size {p.tp_size} / nnodes {p.nnodes} x dp_size {p.dp_size} needs "
            f"{local * p.dp_size} GPUs on this node; torch sees {torch.cuda.device_count()}"
        )
    if p.dist_init_addr is not None:  # replica d meets at port + d on node 0
        host, _, port = p.dist_init_addr.rpartition(":")
        ports = [int(port) + d for d in range(p.dp_size)]
    else:
        host, ports = "127.0.0.1", [free_port() for _ in range(p.dp_size)]
    return [
        RankPlacement(d, p.tp_size, p.nnodes, p.node_rank, rank, f"tcp://{host}:{ports[d]}", backend, cuda)
        for d in range(p.dp_size)
        for rank in range(local)
    ]


def run_worker_node(config: EngineConfig, model_path: str) -> int:
    """`rxf launch` on a node other than 0 of a multi-node group: run this node's scheduler ranks
    (they receive everything from rank 0 over the process group) until one exits or we are stopped."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    engine = EngineProcesses(config, model_path, cancel=stop)
    died: list[str] = []
    engine.watch(lambda reason: (died.append(reason), stop.set()))
    logger.info("node %d: %d scheduler ranks running", config.parallel.node_rank, len(engine.procs))
    stop.wait()
    engine.shutdown()
    if died:
        logger.error("%s", died[0])
        return 1
    return 0


def check_heads_split(config: EngineConfig, model_path: str) -> None:
    """Refuse a tp_size that cannot split the model's attention heads, before any process starts
    (the layers check it again when they are built)."""
    tp = config.parallel.tp_size
    if tp == 1:
        return
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code).get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp:
        raise EngineStartError(f"parallel.tp_size {tp}: the model's num_attention_heads {heads} is not divisible by it")
    if kv_heads % tp and tp % kv_heads:
        raise EngineStartError(
            f"parallel.tp_size {tp}: the model's num_key_value_heads {kv_heads} must divide it or be divisible by it"
        )
