"""The CPU's DECODE forward compiled whole by `torch.compile` (Inductor's C++ code): the CPU
counterpart of CUDA graphs, which a user of vLLM's CPU backend also gets.

A batch-1 step of the demo model is ~10 ms of matmuls and ~8 ms of Python and small ops (30 layers
of norms, rope, SiLU·mul, residual adds, the attention call); compiled, the small ops fuse into a
few loop nests and the step dispatches once: on the quiet 2-core VM, bf16, 128 keys, packed eager ->
compiled 30.5 -> 20.4 ms at batch 1 and one thread, 24.5 -> 17.7 at two; 61.6 -> 44.1 and 50.6 ->
35.8 at batch 16 (`benchmarks/bench_cpu_step.py`; benchmarks/RESULTS.md, issue 22). The matmuls are
`cpu_packing.dense_linear`, an opaque C++ op inside the graph (oneDNN's, or for up to 4 rows rxf's
dot kernel over the plain weight, which took a compiled batch-1 step from 37.9 to 27.0 ms at one
thread and 25.3 to 19.7 at two, measured side by side by the same script).

Compiling takes dynamo ~8 s of tracing per graph and thread count on the 2-core VM with Inductor's
disk cache warm, a minute or more cold, so it runs in a background thread (`runtime.cpu_compile = "background"`)
and decode stays eager until a count's graphs are done, or for good if it fails (no C++ compiler):
start-up does not wait, but the forwards meanwhile run 10-20x slower (`cpu_threads.start_background_compile`).
"startup" waits (benchmarks, tests), "off" (the default) never compiles.

Extends run through the same graphs, as a row per new token (`ModelRunner._extend_rows`), with
the logits of the rows asked for only: the LM head of a 256-token chunk's every row would cost more
than the rest of its forward.

Per thread count two graphs are traced: batch 1 (dynamo specializes size 1) and one dynamic in the
row count, the requests the rows belong to (the backend's table of slots), the key count and the
logits rows, at 7 rows of 5 requests, 13 keys and 3 logits rows (sizes equal to another dimension
would be guarded equal by dynamo's duck sizing; a size of 1 is specialized, so the runner asks for
no fewer than 2 logits rows, and the backend's table holds no fewer than 2 requests, of several
rows). The warm-up runs on an attention backend instance of its own, because the runner's serves
the eager forwards meanwhile (dynamo guards on the backend's type and tensors, not its identity: a
graph traced on one instance serves another), with padding rows as CUDA graphs use them: token 0,
req_to_token rows 0-4 read (any slot there is a valid index) and never written, K/V written to the
reserved slot 0, outputs dropped. A forward whose guards would need a new graph runs eagerly rather
than stall the engine on a compile.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from typing import TYPE_CHECKING

import torch

from rxf.core.runner.cpu_threads import compiling, start_background_compile
from rxf.core.runner.cuda_graph_runner import DecodeBuffers, DecodeInputs

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn

    from rxf.core.attention import AttentionBackend, AttentionContext
    from rxf.core.forward import ForwardBatch

logger = logging.getLogger(__name__)

# (rows, keys, requests, logits rows) of the warm-up forwards: the batch-1 and the dynamic graph
WARM_UP = ((1, 13, 1, 1), (7, 13, 5, 3))
# Intermediate bf16 roundings as eager code makes them: greedy tokens then equal eager decode's
# (without it, one of 6 demo prompts parted from eager within 32 tokens, measured).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


def _entry(threads: int) -> Callable[[nn.Module, ForwardBatch], torch.Tensor]:
    """`model(batch)` as a function whose code object is its own: dynamo keeps compiled graphs per
    code object, so each thread count's graphs live apart."""

    def decode(model: nn.Module, batch: ForwardBatch) -> torch.Tensor:
        return model(batch)

    code = decode.__code__.replace(co_name=f"decode_{threads}_threads")
    return types.FunctionType(code, decode.__globals__, code.co_name)


class CompiledDecode:
    """`__call__(batch)`: the model's decode forward through the graphs compiled for the current
    torch thread count; only where `ready_for(threads)`.

    torch.compile guards on the torch thread count (a forward at another count would need a graph
    of its own), and Inductor's C++ kernels are made for the count they are generated at (run at
    another, 4x slower and more in the helper's runs), so each count that forwards may use
    (`ctx.thread_counts`, the fewer first) gets graphs of its own, compiled one after the other."""

    def __init__(
        self, model: nn.Module, backend: AttentionBackend, ctx: AttentionContext, when: str
    ) -> None:
        self.model = model
        self.backend = backend
        self.ctx = ctx
        self.counts = ctx.thread_counts
        self._compiled = {n: torch.compile(_entry(n), dynamic=True, options=INDUCTOR_OPTIONS) for n in self.counts}
        self._ready: set[int] = set()  # thread counts whose graphs exist
        self.done = threading.Event()  # compiling is over, done or failed
        if when == "startup":
            self._compile()
        else:
            start_background_compile(self._compile, "rxf-cpu-decode-compile")

    def ready_for(self, threads: int) -> bool:
        return threads in self._ready

    def _compile(self) -> None:
        try:
            self.backend.wait_compiled()  # its own kernels first (one compile at a time anyway)
            with torch.inference_mode():  # (outside `compiling`: its warm-up may compile in a thread of its own)
                own = type(self.backend)(self.ctx)
                own.wait_compiled()
            for n in self.counts:
                start = time.perf_counter()
                with compiling(n), torch.inference_mode():
                    for shape in WARM_UP:
                        self._compiled[n](self.model, self._padding_batch(own, *shape))
                self._ready.add(n)
                logger.info("cpu decode: forward compiled for %d threads in %.1f s", n, time.perf_counter() - start)
        except Exception as e:  # e.g. no C++ compiler: Inductor cannot build its kernels
            logger.warning("cpu decode: not compiled (%s: %s); decode stays eager", type(e).__name__, e)
        finally:
            self.done.set()

    def _padding_batch(self, backend: AttentionBackend, rows: int, keys: int, requests: int, logits: int) -> ForwardBatch:
        req_rows = [i % requests for i in range(rows)]
        host = DecodeInputs.pack([0] * rows, [keys - 1] * rows, req_rows, [0] * rows, padded_bs=rows)
        dev = DecodeBuffers.upload(host, self.ctx.device, list(range(logits)))
        batch = dev.forward_batch(host, self.ctx.req_to_token_pool, self.ctx.token_to_kv_pool, backend)
        backend.init_forward_metadata(batch)
        return batch

    # A forward whose guards fail runs eagerly ("fail_on_recompile": raise, for tests).
    on_guard_failure = "eager_on_recompile"

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.compiler.set_stance(self.on_guard_failure):
            return self._compiled[torch.get_num_threads()](self.model, batch)
