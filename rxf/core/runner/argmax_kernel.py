"""The two Triton stages of `argmax.row_argmax` (imported only where Triton and CUDA are)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rxf.core.runner.pdl import use_pdl


@triton.jit
def _keyed(values):
    """NaN as +inf, so that tl.max sees it as the largest (ties with a real +inf resolve to the first
    index, which is torch's answer too unless a +inf precedes the first NaN)."""
    return tl.where(values != values, float("inf"), values)


@triton.jit
def _chunk_max_kernel(X, ChunkMax, ChunkIdx, V, stride_x, num_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the previous kernel writes this one's inputs (rxf/core/runner/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    values = _keyed(tl.load(X + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32))
    best = tl.max(values, axis=0)
    # the first column holding the best value (masked lanes hold -inf: never below a real best)
    first = tl.min(tl.where((values == best) & (cols < V), cols, V), axis=0)
    tl.store(ChunkMax + row * num_chunks + chunk, best)
    tl.store(ChunkIdx + row * num_chunks + chunk, first)


@triton.jit
def _rows_kernel(ChunkMax, ChunkIdx, Out, num_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the previous kernel writes this one's inputs (rxf/core/runner/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    ok = lanes < num_chunks
    best_per_chunk = tl.load(ChunkMax + row * num_chunks + lanes, mask=ok, other=-float("inf"))
    idx = tl.load(ChunkIdx + row * num_chunks + lanes, mask=ok, other=0)
    best = tl.max(best_per_chunk, axis=0)
    # chunks are in column order, so the smallest index among the best chunks is the first column
    big = tl.full((BLOCK,), 2**31 - 1, dtype=tl.int32)
    tl.store(Out + row, tl.min(tl.where(ok & (best_per_chunk == best), idx, big), axis=0).to(tl.int64))


def split_argmax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    rows, vocab = x.shape
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    chunk_idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    pdl = use_pdl(x)
    _chunk_max_kernel[(rows, num_chunks)](x, chunk_max, chunk_idx, vocab, x.stride(0), num_chunks, CHUNK=chunk,
                                          PDL=pdl, launch_pdl=pdl)
    _rows_kernel[(rows,)](chunk_max, chunk_idx, out, num_chunks, BLOCK=max(16, triton.next_power_of_2(num_chunks)),
                          PDL=pdl, launch_pdl=pdl)
    return out
