"""The CPU attention backend: decode reads the paged pool in place, extend is batched across requests.

- DECODE: one C++ op per layer for the whole batch (`cpu_decode.py`): K/V are read from the pool by
  slot inside its loops, never copied out, in float32 whatever the model's dtype (SDPA's CPU kernel
  with a mask is ~4x slower in bf16 than in fp32; this is not).
- EXTEND: the requests are packed into a few padded groups (requests of similar length together, so
  padding stays under `MAX_PADDING` of the work), and each group is one SDPA call (the CPU flash
  kernel) over K/V gathered from the pool once per group and layer: with SDPA's causal flag where no
  member has a cached prefix, else with one mask per group that holds causality, each request's
  length and the layer's sliding window. Layers with a soft-cap or sinks use torch_native's
  `explicit_attention` over the same padded group. Requests of one new token (a MIXED forward's
  decode rows) go to the decode op instead.

Every feature torch_native has (GQA, sliding windows, soft-caps, sinks, an FP8 pool dequantized
with the layer's scales as `rxf.core.kv_pool` defines) runs in both modes. The decode op is built
once per machine (~20 s) and loaded (milliseconds) in a background thread (`COMPILE_ENV`); until it
is ready, and for good without a working C++ compiler (with a warning), decode is torch_native's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rxf.core.attention import AttentionContext, AttentionLayer, layer_features
from rxf.core.runner.cpu_threads import start_background_compile
from rxf.plugins.attention.cpu_decode import decode_attention_op
from rxf.plugins.attention.torch_native import TorchNativeBackend, explicit_attention

if TYPE_CHECKING:
    from rxf.core.forward import ForwardBatch

logger = logging.getLogger(__name__)

# When the decode op is built or loaded: "background" (default: start-up does not wait; decode runs
# torch_native's until it is ready: milliseconds once built, ~20 s of one core the first time on a
# machine) or "startup" (the backend's constructor waits: what benchmarks and tests want).
COMPILE_ENV = "RXF_CPU_ATTENTION_COMPILE"

# A group's padded work (requests x longest new tokens x longest sequence) may exceed the sum of its
# requests' own (new tokens x sequence) by this factor before a request starts a new group.
MAX_PADDING = 1.25


def pack_groups(extend_lens: list[int], seq_lens: list[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Request indices in groups for padded attention: longest sequences first, a request joins the
    current group while the group's padded area stays within `max_padding` of its real area."""
    order = sorted(range(len(seq_lens)), key=lambda i: (seq_lens[i], extend_lens[i]), reverse=True)
    groups: list[list[int]] = []
    real = longest_new = longest_seq = 0
    for i in order:
        e, s = extend_lens[i], seq_lens[i]
        grown = (real + e * s, max(longest_new, e), max(longest_seq, s))
        if groups and (len(groups[-1]) + 1) * grown[1] * grown[2] <= max_padding * grown[0]:
            groups[-1].append(i)
            real, longest_new, longest_seq = grown
        else:
            groups.append([i])
            real, longest_new, longest_seq = e * s, e, s
    return groups


@dataclass
class _Group:
    """One padded extend group of b requests, E = its longest new-token count, S = its longest
    sequence. Padded query row r*E + j is request r's new token j (rows past its count are padding)."""

    q_rows: torch.Tensor  # [b * E] int64: the row of q each padded query row reads (padding: row 0)
    real: torch.Tensor  # [n] int64: the padded rows that are real tokens ...
    dst: torch.Tensor  # [n] int64: ... and the output rows they are written to
    slots: torch.Tensor  # [b, S] int64: the keys' pool slots (padding: slot 0, masked out)
    query_pos: torch.Tensor  # [b, E, 1] int64: absolute positions of the queries (padding: 0)
    key_valid: torch.Tensor  # [b, 1, S] bool: a real key of the request
    # No member has a cached prefix: request r's keys are its new tokens, so SDPA's own causal mask
    # (query j sees keys <= j) is exact for every real row, and its kernel skips the blocks above the
    # diagonal (at 16 x 512 tokens an explicit mask made prefill 1.5x slower).
    no_prefix: bool
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [b, 1, E, S]

    def mask(self, window: int | None) -> torch.Tensor:
        """Query i sees key j iff j is the request's, j <= i and, with a window W, i - W < j. A padding
        row sees key 0 (a real key of every request): no row is all masked."""
        if window not in self.masks:
            key_pos = torch.arange(self.slots.shape[1], device=self.slots.device)[None, None, :]
            visible = self.key_valid & (key_pos <= self.query_pos)
            if window is not None:
                visible &= key_pos > self.query_pos - window
            self.masks[window] = visible.unsqueeze(1)
        return self.masks[window]


@dataclass
class _Rows:
    """An extend's requests of one new token, attended by the decode op."""

    q_rows: torch.Tensor  # [n] int64: their rows in q (and in the output)
    slots: torch.Tensor  # [n, max_len] int64: their keys' slots
    seq_lens: torch.Tensor  # [n] int32
    from_first: torch.Tensor  # [n] int32 zeros: the first visible key without a window


class CpuBackend(TorchNativeBackend):
    auto_priority = 5  # above torch_native (0) on the CPU; GPU backends rank above it on CUDA
    supports_compiled_decode = True

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return device.type == "cpu"

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        self._groups: list[_Group] = []
        self._rows: _Rows | None = None
        self._from_first = torch.empty(0, dtype=torch.int32)  # decode: [bs] zeros, first visible key without a window
        # Made once, so that a decode forward creates and caches nothing (a forward compiled whole must
        # not mutate Python state), as inference tensors like the runner's (dynamo guards on the kind).
        with torch.inference_mode():
            self._no_sinks = torch.full((ctx.num_heads,), float("-inf"), device=ctx.device)  # float32 [heads]: no sink
            self._unit_scale = torch.ones((), dtype=torch.float32, device=ctx.device)  # a model-dtype pool's scale
        # Until the op is ready decode runs torch_native's: the same results up to rounding (in bf16
        # its SDPA rounds the softmax weights to bf16, the op keeps float32).
        self._decode: Callable[..., torch.Tensor] | None = None
        self._step_decode = self._decode
        self.compiled = threading.Event()  # set once compiling is over, done or failed
        when = os.environ.get(COMPILE_ENV, "background")
        if when not in ("background", "startup"):
            raise ValueError(f"{COMPILE_ENV}={when!r}: must be 'background' or 'startup'")
        if when == "startup":
            self._compile()
        else:
            start_background_compile(self._compile, "rxf-cpu-attention-compile")

    def wait_compiled(self) -> None:
        self.compiled.wait()

    def _compile(self) -> None:
        start = time.perf_counter()
        try:
            self._decode = decode_attention_op()
        except Exception as e:  # e.g. no C++ compiler
            logger.warning("cpu attention: no decode op (%s: %s); decode stays torch_native's", type(e).__name__, e)
        else:
            logger.info("cpu attention: decode op ready in %.1f s", time.perf_counter() - start)
        finally:
            self.compiled.set()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata(batch)  # the [bs, max_len] slot table; torch_native's decode state
        self._step_decode = self._decode  # one forward's layers all take the same path
        self._rows = None
        if batch.mode.is_decode():
            self._groups = []
            self._from_first = torch.zeros_like(batch.seq_lens)
        else:
            self._groups = self._plan_extend(batch)

    def _plan_extend(self, batch: ForwardBatch) -> list[_Group]:
        """The padded SDPA groups of the batch's requests; requests of one new token (a MIXED
        forward's decode rows, a prompt's last token) go to the decode op instead (`self._rows`), as
        padded groups they ran SDPA's masked kernel at one query row, ~4x slower in bf16."""
        device = batch.seq_lens.device
        starts, start = [], 0  # each request's first row in q
        for n in batch.extend_lens_cpu:
            starts.append(start)
            start += n
        single = [i for i, n in enumerate(batch.extend_lens_cpu) if n == 1] if self._step_decode is not None else []
        if single:
            index = torch.tensor(single, device=device)
            seq_lens = batch.seq_lens.index_select(0, index)
            self._rows = _Rows(torch.tensor([starts[i] for i in single], device=device),
                               self._slots.index_select(0, index), seq_lens, torch.zeros_like(seq_lens))
        rest = [i for i, n in enumerate(batch.extend_lens_cpu) if n != 1 or not single]
        groups = []
        for packed in pack_groups([batch.extend_lens_cpu[i] for i in rest], [batch.seq_lens_cpu[i] for i in rest]):
            members = [rest[j] for j in packed]
            longest_new = max(batch.extend_lens_cpu[i] for i in members)
            longest_seq = max(batch.seq_lens_cpu[i] for i in members)
            col = torch.arange(longest_new)
            q_rows, query_pos, real, dst = [], [], [], []
            for r, i in enumerate(members):
                n, prefix = batch.extend_lens_cpu[i], batch.prefix_lens_cpu[i]
                is_real = col < n
                q_rows.append(torch.where(is_real, starts[i] + col, 0))
                query_pos.append(torch.where(is_real, prefix + col, 0))
                real.append(r * longest_new + col[:n])
                dst.append(starts[i] + col[:n])
            index = torch.tensor(members, device=device)
            groups.append(
                _Group(
                    q_rows=torch.cat(q_rows).to(device),
                    real=torch.cat(real).to(device),
                    dst=torch.cat(dst).to(device),
                    slots=self._slots[index, :longest_seq],
                    query_pos=torch.stack(query_pos).to(device)[:, :, None],
                    key_valid=self._valid[index, None, :longest_seq],
                    no_prefix=not any(batch.prefix_lens_cpu[i] for i in members),
                )
            )
        return groups

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self._store_kv(layer, batch, k, v)
        plain = not (layer_features(layer) - {"sliding_window"})  # SDPA takes the window in its mask
        gqa = layer.num_heads != layer.num_kv_heads
        out = torch.empty_like(q)
        if self._rows is not None:
            rows = self._rows
            out.index_copy_(0, rows.q_rows, self._attend_rows(q.index_select(0, rows.q_rows), layer, batch, rows.slots,
                                                               rows.seq_lens, rows.from_first))
        for g in self._groups:
            qg = q.index_select(0, g.q_rows).view(len(g.slots), -1, *q.shape[1:]).transpose(1, 2)  # [b, H, E, D]
            kg, vg = (x.transpose(1, 2) for x in self._read_kv(layer, batch, g.slots, q.dtype))  # [b, Hkv, S, D]
            if plain and g.no_prefix and layer.sliding_window is None:
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=layer.scaling, enable_gqa=gqa)
            elif plain:
                mask = g.mask(layer.sliding_window)
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=layer.scaling, enable_gqa=gqa)
            else:
                o = explicit_attention(qg, kg, vg, g.mask(layer.sliding_window), layer)
            out.index_copy_(0, g.dst, o.transpose(1, 2).flatten(0, 1).index_select(0, g.real))
        return out

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        if self._step_decode is None:
            return super().forward_decode(q, k, v, layer, batch)
        self._store_kv(layer, batch, k, v)
        return self._attend_rows(q, layer, batch, self._slots, batch.seq_lens, self._from_first)

    def _attend_rows(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, slots: torch.Tensor, seq_lens: torch.Tensor,
        from_first: torch.Tensor,
    ) -> torch.Tensor:
        """The decode op for rows of one query each: row i at position seq_lens[i] - 1 over its keys
        `slots[i, :seq_lens[i]]` (stored already). `from_first`: zeros, the first key without a window."""
        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        # An FP8 pool holds k / k_scale and v / v_scale; a pool of the model dtype holds K/V as they are.
        k_scale, v_scale = (layer.k_scale, layer.v_scale) if pool.is_fp8 else (self._unit_scale, self._unit_scale)
        window = layer.sliding_window
        first = from_first if window is None else (seq_lens - window).clamp_min(0)
        sinks = layer.sinks
        if sinks is None:
            sinks = self._no_sinks
            if layer.num_heads != sinks.numel():  # a layer of its own head count (none of today's models)
                sinks = torch.full((layer.num_heads,), float("-inf"), device=q.device)
        return self._step_decode(
            q, k_buf, v_buf, k_scale, v_scale, slots, seq_lens, first, sinks, layer.scaling, layer.logit_cap,
        )
