"""The scheduler process: ModelRunner + Scheduler behind ZMQ sockets, one process per
tensor-parallel rank.

Rank 0 of a replica PULLs from the TokenizerManager (requests, aborts, admin), PUSHes token outputs
to the detokenizer and admin replies straight back to the TokenizerManager. Every loop iteration it
broadcasts the messages it received (possibly none), still encoded, to the other ranks, which have
no sockets: all ranks decode and apply the same messages and run the same `step()`, so their
schedulers make the same decisions
and their forwards meet in the same collectives. They also sample the same tokens without talking:
the logits head all-gathers the vocabulary shards, so every rank holds rank 0's logits bit for bit,
and sampling draws from generators seeded identically on every rank (the request's seed, else
`runtime.seed`) in the same order.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from rxf.core.config import EngineConfig
from rxf.core.ipc import codec
from rxf.core.ipc.messages import (
    STATS_INTERVAL_S,
    AbortReq,
    AdminReply,
    AdminResult,
    BatchTokenOut,
    FlushCacheReq,
    GetStatsReq,
    PreparedRequest,
    ProfileReq,
    RankBroadcast,
    StatsReply,
    StatsSnapshot,
    ToScheduler,
)
from rxf.core.launch.heap import IdleHeapTrimmer
from rxf.core.runner.placement import RankPlacement

logger = logging.getLogger(__name__)

_REQUESTS = codec.Decoder(ToScheduler)
_BROADCAST = codec.Decoder(RankBroadcast)


def _on_cpu(config: EngineConfig) -> bool:
    import torch

    return config.runtime.device == "cpu" or (config.runtime.device == "auto" and not torch.cuda.is_available())


def run_scheduler_process(
    config: EngineConfig,
    model_path: str,
    addrs: dict[str, str],
    placement: RankPlacement | None,
    ready_conn: Any,
) -> None:
    """`placement` None: the only rank of the only replica (no process group)."""
    from rxf.core.launch.logging_setup import setup_logging

    where = "" if placement is None else f" dp{placement.dp_rank} tp{placement.rank}"
    setup_logging(config.runtime.log_level, prefix=f"scheduler{where}")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        import torch

        from rxf.core.load_tokenizer import load_tokenizer
        from rxf.core.registry import PluginRegistry
        from rxf.core.runner.cpu_threads import CpuThreads, usable_cores
        from rxf.core.runner.distributed import init_tensor_parallel
        from rxf.core.runner.model_runner import ModelRunner
        from rxf.core.runner.process_family import ProcessFamily
        from rxf.core.scheduler.scheduler import Scheduler
        from rxf.core.speculative.draft import load_draft_model
        from rxf.core.speculative.eagle import load_eagle3, target_aux_layers

        if placement is not None:
            if placement.cuda:  # before any CUDA work: "cuda" then means this rank's device
                torch.cuda.set_device(placement.device_index)
            elif config.runtime.cpu_threads is None:  # share the cores instead of each taking all
                torch.set_num_threads(max(1, usable_cores() // (placement.local_size * config.parallel.dp_size)))
            init_tensor_parallel(placement, timeout_s=config.runtime.startup_timeout_s + 1800)
        threads = None
        if placement is None and config.runtime.cpu_threads is None and _on_cpu(config):
            # All cores while no other program runs (the engine's own processes aside), else one fewer.
            threads = CpuThreads(usable_cores(), ProcessFamily())
        registry = PluginRegistry.load(config.plugins.allow, config.plugins.deny)
        runner = ModelRunner(config, registry, model_path, aux_hidden_layers=target_aux_layers(config, model_path),
                             threads=threads)
        tokenizer = load_tokenizer(config.model.tokenizer_path or model_path)
        draft = load_draft_model(config, registry, runner) or load_eagle3(config, registry, runner)
        scheduler = Scheduler(
            config, runner, tokenizer, check_memory=os.environ.get("RXF_CHECK_MEMORY") == "1", draft=draft
        )
    except Exception as e:  # report start-up failures to the parent instead of dying silently
        logger.exception("scheduler failed to start")
        ready_conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    leader = placement is None or placement.rank == 0
    sockets = _Sockets(addrs, 0 if placement is None else placement.dp_rank) if leader else None
    ready_conn.send(
        {
            "max_total_tokens": runner.max_total_tokens,
            "max_context_len": runner.max_context_len,
            "vocab_size": runner.vocab_size,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "attention_backend": type(runner.attn_backend).__name__,
            "architecture": type(runner.model).__name__,
            "torch_threads": torch.get_num_threads(),
            "tp_size": config.parallel.tp_size,
            "dp_size": config.parallel.dp_size,
            "pooling": runner.pooling.to_info() if runner.pooling is not None else None,
        }
    )
    _loop(scheduler, sockets, "dp0-tp0" if placement is None else f"dp{placement.dp_rank}-tp{placement.rank}")


class _Sockets:
    """Rank 0's ZMQ sockets."""

    def __init__(self, addrs: dict[str, str], dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.stats_sent_at = float("-inf")
        ctx = zmq.Context()
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(addrs["scheduler"])
        self.to_detok = ctx.socket(zmq.PUSH)
        self.to_detok.connect(addrs["detokenizer"])
        self.to_tm = ctx.socket(zmq.PUSH)
        self.to_tm.connect(addrs["tokenizer"])
        self.poller = zmq.Poller()
        self.poller.register(self.recv, zmq.POLLIN)

    def receive(self, timeout_ms: int) -> list[memoryview]:
        """Whatever arrived, still encoded, waiting up to `timeout_ms` for the first message. Each
        is a view of its ZMQ frame (no copy), so a request's tensors decode in place."""
        frames = []
        while self.poller.poll(timeout_ms):
            timeout_ms = 0
            frames.append(self.recv.recv(copy=False).buffer)
        return frames

    def send_tm(self, msg: Any) -> None:
        self.to_tm.send(codec.encode(msg), copy=False)

    def publish_stats(self, scheduler: Any, force: bool = False) -> None:
        """Send a `StatsSnapshot` when `force`d, when the scheduler is idle (its final figures, e.g.
        every slot back after a drain, are then exact), or `STATS_INTERVAL_S` after the last one."""
        now = time.monotonic()
        if force or not scheduler.has_work or now - self.stats_sent_at >= STATS_INTERVAL_S:
            self.send_tm(StatsSnapshot(self.dp_rank, scheduler.stats()))
            self.stats_sent_at = now


def _share(frames: list[memoryview] | None) -> list[memoryview] | None:
    """Rank 0's received `frames` on every rank of the replica (None: rank 0 stops); rank 0 alone
    has sockets, the other ranks' argument is ignored. Nothing received costs one 8-byte broadcast."""
    from rxf.core.runner.distributed import broadcast_from_rank0, tp_rank, tp_size

    if tp_size() == 1:
        return frames
    leader = tp_rank() == 0
    payload = codec.encode(RankBroadcast(frames or [], stop=frames is None)) if leader and frames != [] else b""
    data = broadcast_from_rank0(payload)
    if leader:
        return frames
    if not data:
        return []
    shared = _BROADCAST.decode(data)
    return None if shared.stop else shared.frames


def _loop(scheduler: Any, sockets: _Sockets | None, rank_name: str) -> None:
    """The step loop of every rank; `sockets` only on rank 0, whose messages every rank applies."""
    parent = os.getppid()
    heap = IdleHeapTrimmer()
    if sockets is not None:
        sockets.publish_stats(scheduler, force=True)
    while True:
        frames: list[memoryview] | None = []
        if sockets is not None:
            if os.getppid() != parent:  # the engine's owner died without stopping us: don't linger
                logger.warning("parent process exited; scheduler stopping")
                _share(None)
                return
            # Block only when idle (the other ranks wait in the broadcast meanwhile); otherwise take
            # whatever arrived and keep stepping.
            frames = sockets.receive(0 if scheduler.has_work else 1000)
        frames = _share(frames)
        if frames is None:
            return
        outs = _apply(scheduler, frames, sockets, rank_name)
        stepped = scheduler.has_work
        if stepped:
            outs += scheduler.step()
            heap.busy()
        elif not frames:
            heap.idle()
        if sockets is not None:
            if frames or stepped:  # else nothing changed since the last snapshot
                sockets.publish_stats(scheduler)  # first: it then usually lands before the outputs
            if outs:
                sockets.to_detok.send(codec.encode(BatchTokenOut(outs)), copy=False)


def _apply(scheduler: Any, frames: list[memoryview], sockets: _Sockets | None, rank_name: str) -> list[Any]:
    """Decode and apply the received messages in order; admin replies go out from rank 0 only.
    Every rank decodes the same bytes, so a message none can decode is dropped by all of them."""
    outs = []
    for frame in frames:
        try:
            msg = _REQUESTS.decode(frame)
        except msgspec.MsgspecError as exc:  # a bug in the sender, not a client's doing: say so
            logger.error("scheduler: undecodable message (%s): %s", exc, bytes(frame[:64]))
            continue
        if isinstance(msg, PreparedRequest):
            scheduler.add_request(msg)
        elif isinstance(msg, AbortReq):
            outs += scheduler.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok, text = scheduler.flush_cache()
            if sockets is not None:  # the snapshot first: a caller of the flush then reads its effect
                sockets.publish_stats(scheduler, force=True)
                sockets.send_tm(AdminReply(msg.req_id, AdminResult(ok, text)))
        elif isinstance(msg, GetStatsReq) and sockets is not None:
            sockets.send_tm(StatsReply(msg.req_id, scheduler.stats()))
        elif isinstance(msg, ProfileReq):
            result = _profile(scheduler, msg, rank_name)
            if sockets is not None:
                sockets.send_tm(AdminReply(msg.req_id, result))
    return outs


def _profile(scheduler: Any, msg: ProfileReq, rank_name: str) -> AdminResult:
    """Start or stop this rank's step profile; the result's message is the profile's folder (every
    rank writes a subfolder of its own there) or why it was refused."""
    root = scheduler.config.runtime.profile_dir
    if root is None:
        return AdminResult(False, "profiling is off: set runtime.profile_dir to the folder for profiles")
    try:
        if msg.start:
            folder = Path(root) / msg.name
            scheduler.runner.start_profile(folder / rank_name, msg.num_steps, msg.kernels)
        else:
            folder = scheduler.runner.stop_profile().parent
    except (ValueError, OSError) as exc:
        return AdminResult(False, str(exc))
    return AdminResult(True, str(folder))
