"""The scheduler process: ModelRunner + Scheduler behind ZMQ sockets.

PULL from the TokenizerManager (requests, aborts, admin), PUSH token outputs to the detokenizer,
PUSH admin replies straight back to the TokenizerManager.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import zmq

from rxf.core.config import EngineConfig
from rxf.core.io_struct import (
    AbortReq,
    BatchTokenOut,
    FlushCacheReq,
    FlushCacheResult,
    GetStatsReq,
    TokenizedGenerateReq,
)

logger = logging.getLogger(__name__)


def run_scheduler_process(config: EngineConfig, model_path: str, addrs: dict[str, str], ready_conn: Any) -> None:
    from rxf.entrypoints.logging_setup import setup_logging

    setup_logging(config.runtime.log_level, prefix="scheduler")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        import torch
        from transformers import AutoTokenizer

        from rxf.core.model_runner import ModelRunner
        from rxf.core.registry import PluginRegistry
        from rxf.core.scheduler.scheduler import Scheduler

        registry = PluginRegistry.load(config.plugins.allow, config.plugins.deny)
        runner = ModelRunner(config, registry, model_path)
        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or model_path)
        scheduler = Scheduler(config, runner, tokenizer, check_memory=os.environ.get("RXF_CHECK_MEMORY") == "1")
    except Exception as e:  # report start-up failures to the parent instead of dying silently
        logger.exception("scheduler failed to start")
        ready_conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(addrs["scheduler"])
    to_detok = ctx.socket(zmq.PUSH)
    to_detok.connect(addrs["detokenizer"])
    to_tm = ctx.socket(zmq.PUSH)
    to_tm.connect(addrs["tokenizer"])
    ready_conn.send(
        {
            "max_total_tokens": runner.max_total_tokens,
            "max_context_len": runner.max_context_len,
            "vocab_size": runner.vocab_size,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "attention_backend": type(runner.attn_backend).__name__,
            "architecture": type(runner.model).__name__,
            "torch_threads": torch.get_num_threads(),
        }
    )
    _loop(scheduler, recv, to_detok, to_tm)


def _loop(scheduler: Any, recv: zmq.Socket, to_detok: zmq.Socket, to_tm: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the engine's owner died without stopping us: don't linger
            logger.warning("parent process exited; scheduler stopping")
            return
        # Block only when idle; otherwise take whatever arrived and keep stepping.
        timeout = 0 if scheduler.has_work else 1000
        outs = []
        while poller.poll(timeout):
            timeout = 0
            msg = recv.recv_pyobj()
            if isinstance(msg, TokenizedGenerateReq):
                immediate = scheduler.add_request(msg)
                if immediate is not None:
                    outs.append(immediate)
            elif isinstance(msg, AbortReq):
                outs += scheduler.abort(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                ok, text = scheduler.flush_cache()
                to_tm.send_pyobj(FlushCacheResult(ok, text))
            elif isinstance(msg, GetStatsReq):
                to_tm.send_pyobj(scheduler.stats())
            else:
                logger.error("scheduler: unexpected message %r", type(msg).__name__)
        if scheduler.has_work:
            outs += scheduler.step()
        if outs:
            to_detok.send_pyobj(BatchTokenOut(outs))
