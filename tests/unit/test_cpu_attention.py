"""The cpu attention backend against torch_native (one layer, scattered pool slots, stale
req_to_token entries) and against transformers (tiny checkpoints through ModelRunner and Runtime).

Covers: extend over cached prefixes, mixed batches (requests of very different lengths, a MIXED
forward's one-token rows beside prompt chunks), decode, GQA, sliding windows, soft-caps and sinks,
fp32 and bf16, an FP8 pool with scales, the op's planning of rows that share or nest their keys, and
greedy tokens through the scheduler with chunked prefill and the radix cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rxf.plugins.attention.cpu import COMPILE_ENV, CpuBackend
from rxf.testing import make_tiny_checkpoint
from rxf.testing.attention import assert_bf16_close, compare_backends, make_case
from rxf.testing.model_parity import check_logits, check_runtime_greedy

SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 8},
    "cap": {"logit_cap": 0.9},
    "sinks": {"sinks": SINKS},
    "all": {"sliding_window": 5, "logit_cap": 0.8, "sinks": SINKS},
}
SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 16, "device": "cpu"}  # GQA 2
BATCHES = {
    # request 0: a cached prefix past the window; 1: new tokens across the window edge; 2: no prefix
    "extend over prefixes": ([40, 3, 0], [5, 20, 11]),
    "mixed lengths": ([0, 0, 0, 12], [1, 60, 7, 2]),  # a one-token prompt, a long one, and short ones
    # a MIXED forward: decode rows (one new token over a prefix, the decode op's) beside a prompt chunk
    "decode rows and a chunk": ([30, 0, 17, 9], [1, 9, 1, 4]),
    "decode": ([1, 7, 30, 45], [1, 1, 1, 1]),
    "decode batch 1": ([9], [1]),
}


@pytest.fixture(autouse=True)
def compile_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend built here (Runtime's scheduler too) waits for its decode op, so decode runs
    the op, not the torch_native fallback it uses meanwhile."""
    monkeypatch.setenv(COMPILE_ENV, "startup")


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("features", list(FEATURES))
def test_matches_torch_native_fp32(features: str, batch: str) -> None:
    out, ref, k, ref_k = compare_backends(CpuBackend, *BATCHES[batch], **SHAPE, dtype=torch.float32, **FEATURES[features])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k, ref_k), "the pools must hold the same K after the forward"


@pytest.mark.parametrize("batch", ["extend over prefixes", "decode rows and a chunk", "decode"])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_matches_torch_native_bf16(features: str, batch: str) -> None:
    out, ref, k, ref_k = compare_backends(CpuBackend, *BATCHES[batch], **SHAPE, dtype=torch.bfloat16, **FEATURES[features])
    assert_bf16_close(out, ref)
    assert torch.equal(k, ref_k)


@pytest.mark.parametrize("batch", ["extend over prefixes", "decode rows and a chunk", "decode"])
def test_fp8_pool_matches_torch_native(batch: str) -> None:
    """An FP8 pool with non-unit scales: both backends quantize on store and dequantize on read."""
    out, ref, k, ref_k = compare_backends(
        CpuBackend, *BATCHES[batch], **SHAPE, dtype=torch.float32, kv_dtype=torch.float8_e4m3fn,
        kv_scales=(0.5, 2.0), **FEATURES["all"],
    )
    # torch_native rounds the dequantized K/V to q's dtype (fp32 here) as the kernel does not: ~1e-6
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k.view(torch.uint8), ref_k.view(torch.uint8))


def test_background_compile_takes_over_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPILE_ENV, "background")
    ctx = make_case([4], [1], **SHAPE, dtype=torch.float32)[0]
    backend = CpuBackend(ctx)
    assert backend.compiled.wait(120), "the background compile did not finish"
    assert backend._op is not None
    monkeypatch.setenv(COMPILE_ENV, "soon")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        CpuBackend(ctx)


# Run in a fresh interpreter with an empty cache (a build is due) and a compiler that fails at once:
# prints the torch._dynamo / torch._inductor modules the build thread imported itself.
BUILD_THREAD_IMPORTS = """
import threading
import sys
import torch
from rxf.plugins.attention.cpu import CpuBackend
from rxf.testing.attention import make_case

class Recorder:
    seen = set()
    def find_spec(self, name, path, target=None):
        if name.startswith(("torch._dynamo", "torch._inductor")) and threading.current_thread().name != "MainThread":
            self.seen.add(name)

sys.meta_path.insert(0, Recorder())
backend = CpuBackend(make_case([4], [1], heads=4, kv_heads=2, head_dim=16, device="cpu", dtype=torch.float32)[0])
backend.compiled.wait()
print(sorted(Recorder.seen))
"""


def test_a_background_build_leaves_torchs_compiler_imports_to_the_starting_thread(tmp_path: Path) -> None:
    """torch._dynamo and torch._inductor import each other: imported by two threads at once, one
    gets a _DeadlockError and the other a half-initialized module (a fresh machine's first start:
    the build thread's ISA probe beside the compiled forward's torch.compile crashed the engine, 3
    of 4 times). The build thread must find them imported."""
    env = dict(os.environ, RXF_CACHE_DIR=str(tmp_path), CXX="/bin/false", **{COMPILE_ENV: "background"})
    out = subprocess.run([sys.executable, "-c", BUILD_THREAD_IMPORTS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no working c++ compiler" in out.stderr.lower(), out.stderr[-2000:]  # the build did run, and failed
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_decode_op_at_the_head_dims_it_unrolls(head_dim: int, features: str) -> None:
    """The op's compile-time head dims (64, 128; the tests above run its generic loop at 16), with
    the demo's GQA (9 heads over 3), keys past one block, and a single request whose keys are split
    into chunks merged at the end."""
    shape = {"heads": 9, "kv_heads": 3, "head_dim": head_dim, "device": "cpu"}
    extra = {**FEATURES[features], "sinks": torch.linspace(-1.0, 2.0, 9)} if features == "all" else {}
    for prefixes in ([600], [1, 70, 33, 250]):
        out, ref, _, _ = compare_backends(CpuBackend, prefixes, [1] * len(prefixes), **shape, dtype=torch.float32,
                                          **extra)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # GQA (4 heads over 2), head_dim 16, and a window on no layer: the plain paths.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", seed=5)


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mistral"), "MistralForCausalLM", seed=3, sliding_window=16)


def prompts(vocab: int = 512) -> list[list[int]]:
    return [[(5 + 7 * i + 3 * n) % vocab for i in range(n)] for n in (40, 9, 77)]


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_mistral"])
def test_logits_match_transformers(model: str, request: pytest.FixtureRequest) -> None:
    check_logits(request.getfixturevalue(model), prompts(), attention_backend="cpu")


def test_runtime_greedy_matches_transformers(tiny_mistral: Path) -> None:
    check_runtime_greedy(tiny_mistral, prompts(), chunk=8, new_tokens=16, attention={"backend": "cpu"})


def _reference_decode(q, k_buf, v_buf, slots, seq_lens, first_key, sinks, scale, cap):
    """Decode attention per request in float32 torch ops (keys first_key[i] <= j < seq_lens[i])."""
    heads, group = q.shape[1], q.shape[1] // k_buf.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        rows = slots[i, int(first_key[i]):int(seq_lens[i])]
        k = k_buf[rows].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_buf[rows].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        w = torch.softmax(torch.cat([s, sinks.view(heads, 1)], dim=1), dim=1)[:, :-1]
        out[i] = torch.einsum("hn,nhd->hd", w, v).to(q.dtype)
    return out


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_decode_op_over_shared_prefixes(head_dim: int, features: str) -> None:
    """Requests whose leading slots are the same (a prompt prefix shared through the radix cache)
    are scored together over those keys: their outputs are each request's own attention. Covers
    groups of several requests in batch order apart, a request that is all prefix, one whose
    prefix with the group ends early (a divergent slot), a window (first_key) that starts inside
    the shared run, and a lone request."""
    from rxf.plugins.attention.cpu_decode import decode_attention_op

    torch.manual_seed(0)
    heads, kv_heads = 9, 3
    pool = torch.randn(2, 4096, kv_heads, head_dim)
    k_buf, v_buf = pool[0], pool[1]
    prefix_a, prefix_b = list(range(100, 400)), list(range(1000, 1130))
    fresh = iter(range(2000, 4096))
    rows = [
        prefix_a + [next(fresh) for _ in range(40)],
        prefix_b + [next(fresh) for _ in range(7)],
        prefix_a + [next(fresh) for _ in range(3)],
        prefix_a[:250] + [next(fresh) for _ in range(60)],  # parts from the group after 250 keys
        prefix_b,  # all prefix
        [next(fresh) for _ in range(90)],
        prefix_a + [next(fresh) for _ in range(12)],
    ]
    bs, width = len(rows), max(map(len, rows))
    slots = torch.zeros(bs, width, dtype=torch.long)
    for i, row in enumerate(rows):
        slots[i, : len(row)] = torch.tensor(row)
    seq_lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    first_key = torch.zeros(bs, dtype=torch.int32)
    sinks, cap = torch.full((heads,), float("-inf")), None
    if features == "all":
        first_key[[0, 2, 6]] = torch.tensor([30, 30, 30], dtype=torch.int32)  # a window: the group still shares
        sinks, cap = torch.linspace(-1.0, 2.0, heads), 0.9
    q = torch.randn(bs, heads, head_dim)
    one = torch.tensor(1.0)
    op = decode_attention_op()
    ref = _reference_decode(q, k_buf, v_buf, slots, seq_lens, first_key, sinks, head_dim**-0.5, cap)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):  # one thread's run of tasks, and two threads' split of them
            torch.set_num_threads(threads)
            out = op(q, k_buf, v_buf, one, one, slots, torch.arange(bs), seq_lens, first_key, sinks, head_dim**-0.5,
                     cap)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("features", ["plain", "all"])
def test_decode_op_over_nested_rows(features: str) -> None:
    """Rows of extends (one per new token, over its request's keys up to itself, in a shuffled batch):
    a fresh 300-token prompt (its rows split into runs over the threads), a chunk over a 200-key
    prefix (read once for all its rows, then causally), two requests' chunks past a prefix they share
    with a decode row, a verify's five rows over 400 keys, a lone decode row, and a row whose slots
    match another's only in part. Each row's output is its own attention."""
    from rxf.plugins.attention.cpu_decode import decode_attention_op

    torch.manual_seed(1)
    heads, kv_heads, head_dim = 9, 3, 64
    pool = torch.randn(2, 8192, kv_heads, head_dim)
    fresh = iter(torch.randperm(8191)[:4000].add(1).tolist())

    def take(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    shared = take(150)
    requests = [(take(300), 0), (take(240), 200), (shared + take(20), 150), (shared + take(20), 150),
                (take(400), 395), (take(90), 89)]
    rows: list[tuple[list[int], int]] = [(slots, n) for slots, prefix in requests for n in range(prefix + 1, len(slots) + 1)]
    rows.append((shared + take(5), 155))  # a decode row in the shared prefix's group
    rows.append((requests[0][0][:100] + take(30), 130))  # nests with the prompt's rows only up to key 100
    order = torch.randperm(len(rows)).tolist()
    rows = [rows[i] for i in order]
    # The op's table holds each request's slots once; slot_rows says which one a row reads.
    requests = list(dict.fromkeys(tuple(s) for s, _ in rows))
    table = torch.zeros(len(requests), max(map(len, requests)), dtype=torch.long)
    for i, request in enumerate(requests):
        table[i, : len(request)] = torch.tensor(request)
    slot_rows = torch.tensor([requests.index(tuple(s)) for s, _ in rows])
    slots = table[slot_rows]
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    first_key = torch.zeros(len(rows), dtype=torch.int32)
    sinks, cap = torch.full((heads,), float("-inf")), None
    if features == "all":  # a window of 100 keys on the 240-key request's rows (their first keys differ)
        windowed = torch.tensor([len(s) == 240 for s, _ in rows])
        first_key = torch.where(windowed, (seq_lens - 100).clamp_min(0), first_key).to(torch.int32)
        sinks, cap = torch.linspace(-1.0, 2.0, heads), 0.9
    q = torch.randn(len(rows), heads, head_dim)
    one = torch.tensor(1.0)
    ref = _reference_decode(q, pool[0], pool[1], slots, seq_lens, first_key, sinks, head_dim**-0.5, cap)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = decode_attention_op()(q, pool[0], pool[1], one, one, table, slot_rows, seq_lens, first_key, sinks,
                                        head_dim**-0.5, cap)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)
