"""Attention over the paged KV pool, read in place: a C++ op (`csrc/paged_decode.cpp`), built on first
use (`cpp_build`) and registered as `torch.ops.rxf_cpu.paged_decode_attention`.

    paged_decode_attention(q, k_buf, v_buf, k_scale, v_scale, slots, slot_rows, seq_lens, first_key, sinks, scale, cap)

One query per row: q [bs, H, D] (the model's dtype); k_buf / v_buf [num_slots, Hkv, D], a layer's
pool buffers (the model's dtype, or FP8 read as k_buf * k_scale, v_buf * v_scale: 0-d float32
scales, 1.0 but for an FP8 pool); slots int64 [n, L], a table of key slots, and slot_rows int64
[bs]: row i's keys are slots[slot_rows[i], j] for first_key[i] <= j < seq_lens[i] (first_key: 0,
or with a sliding window W, seq_lens[i] - W) -> [bs, H, D] in q's dtype. A decoding request is a
row; so is each new token of an extend, over its request's table row up to itself. `cap`: scores
become cap * tanh(s / cap); `sinks` float32 [H]: one more logit per head in the softmax's
denominator, -inf for none (see rxf.core.attention). Scores, softmax and sums are float32 whatever
the dtypes. Rows whose visible keys start with the same run of slots (a prompt prefix shared
through the radix cache) are scored together over that run, and rows whose keys nest (an extend's
tokens) together causally: each block of keys is read, converted and transposed once for all the
rows that read it.

Why C++: `torch.compile` of the same computation written as gathers and reductions (this module's
previous form) generated one horizontal sum per score, several passes and per-element bounds
checks: 16 requests x 550 keys of the demo's shapes took 1.6-3.0 ms a layer against 0.6-1.2 ms
for this kernel (1-2 threads; SDPA over gathered K/V with a mask is slower still in bf16;
benchmarks/RESULTS.md, issue 22). The op is opaque to torch.compile (a fake kernel gives its
output's shape), so a decode forward compiled whole calls it as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from rxf.plugins.attention.cpp_build import load_ops

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_lock = threading.Lock()


def decode_attention_op() -> Callable[..., torch.Tensor]:
    """The op, built and loaded on the first call of the process (raises when it cannot be built)."""
    with _lock:
        if not hasattr(torch.ops.rxf_cpu, "paged_decode_attention"):
            load_ops(SOURCE)
            torch.library.register_fake("rxf_cpu::paged_decode_attention")(_output_like_q)
    return torch.ops.rxf_cpu.paged_decode_attention


def _output_like_q(q: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(q)
