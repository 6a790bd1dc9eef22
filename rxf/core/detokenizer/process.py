"""The detokenizer process: `Detokenizer` behind a PULL socket (token batches from the scheduler) and
a PUSH socket (text batches to the TokenizerManager)."""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

import msgspec
import zmq

from rxf.core.detokenizer.detokenizer import Detokenizer
from rxf.core.ipc import codec
from rxf.core.ipc.messages import ToDetokenizer

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from types import FrameType

logger = logging.getLogger(__name__)

# How often (ms) the idle process loop wakes up to check that its parent is still alive.
_PARENT_CHECK_MS = 1000

_DECODER = codec.Decoder(ToDetokenizer)


class _Shutdown(BaseException):
    """Raised by the SIGTERM handler to unwind the process loop from wherever it is."""


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise _Shutdown(signal.Signals(signum).name)


def run_detokenizer_process(
    tokenizer_path: str, recv_addr: str, send_addr: str, ready_conn: Connection
) -> None:
    """Process entry: PULL `BatchTokenOut` on `recv_addr` (bound), PUSH `BatchStrOut` to
    `send_addr` (connected). Sends "ready" on `ready_conn` once listening, or ``{"error": reason}``
    if the tokenizer or the sockets fail (then exits with that exception). Runs until SIGTERM
    (exit code 0) or until its parent process dies (SIGINT is ignored: the parent owns shutdown)."""
    # Raising from the handler (rather than setting a flag) also unblocks a send to a peer that
    # is gone, so the process always exits promptly.
    signal.signal(signal.SIGTERM, _raise_shutdown)
    try:
        _serve(tokenizer_path, recv_addr, send_addr, ready_conn)
    except _Shutdown as sig:
        logger.info("detokenizer: exiting on %s", sig)


def _serve(tokenizer_path: str, recv_addr: str, send_addr: str, ready_conn: Connection) -> None:
    parent_pid = os.getppid()
    ctx = zmq.Context()
    try:
        try:
            from rxf.core.load_tokenizer import load_tokenizer

            detokenizer = Detokenizer(load_tokenizer(tokenizer_path))
            recv = ctx.socket(zmq.PULL)
            send = ctx.socket(zmq.PUSH)
            recv.bind(recv_addr)
            send.connect(send_addr)
        except Exception as exc:
            ready_conn.send({"error": f"{type(exc).__name__}: {exc}"})
            raise
        ready_conn.send("ready")
        logger.info("detokenizer: ready (recv %s, send %s)", recv_addr, send_addr)
        while True:
            if not recv.poll(_PARENT_CHECK_MS):
                if os.getppid() != parent_pid:
                    logger.warning("detokenizer: parent process exited; exiting")
                    return
                continue
            data = recv.recv()
            try:
                batch = _DECODER.decode(data)
            except msgspec.MsgspecError as exc:  # a bug in the scheduler, not a client's doing
                logger.error("detokenizer: undecodable message (%s): %s", exc, data[:64])
                continue
            result = detokenizer.handle(batch)
            if result.outs:
                send.send(codec.encode(result), copy=False)
    finally:
        # Linger 0: drop unsent text rather than wait on exit for a reader that may be gone.
        ctx.destroy(linger=0)
