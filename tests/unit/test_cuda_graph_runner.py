"""The decode hot path's host-side logic, on CPU: the CUDA-graph runner's buckets, padding, budget,
can_run and config; and a step's one packed read-back with logprobs only on demand."""

from __future__ import annotations

import pytest
import torch

from rxf.core.config import ConfigError, CudaGraphConfig, load_config
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import PreparedRequest, RequestOptions
from rxf.core.kv_pool import ReqToTokenPool, TokenToKVPool
from rxf.core.kvcache.kv_manager import KVHandle
from rxf.core.runner.cuda_graph_runner import (
    CudaGraphRunner,
    DecodeBuffers,
    DecodeInputs,
    capture_sizes,
    fits_budget,
    pick_bucket,
)
from rxf.core.runner.sampling import gather_logprobs
from rxf.core.runner.step_io import StepBatch
from rxf.core.runner.step_runner import StepExecutor
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.req import Req
from rxf.plugins.attention.torch_native import TorchNativeBackend


def test_default_sizes_capped_by_running_requests() -> None:
    cfg = CudaGraphConfig()
    assert capture_sizes(cfg, 1000) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(cfg, 64)[-4:] == [40, 48, 56, 64]
    assert capture_sizes(cfg, 60)[-2:] == [56, 60]  # the cap itself is always a bucket
    assert capture_sizes(cfg, 3) == [1, 2, 3]
    assert capture_sizes(CudaGraphConfig(max_bs=20), 64) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(CudaGraphConfig(batch_sizes=[32, 1, 1, 5]), 64) == [1, 5, 32, 64]


def test_pick_bucket() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [pick_bucket(sizes, n) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert pick_bucket(sizes, 17) is None
    assert pick_bucket([], 1) is None


def test_budget_skips_large_buckets_first() -> None:
    assert fits_budget(0.0, None, 30, 1.0)  # nothing measured yet: the first capture always runs
    assert fits_budget(1.0, 0.5, 4, 3.0)
    assert not fits_budget(1.0, 0.5, 5, 3.0)  # this bucket and 4 smaller ones: 3.5s > 3s, so skip it
    assert fits_budget(1.0, 0.5, 4, 3.0)  # ...and the next smaller one (4 left) fits


def test_pack_pads_rows_to_slot_zero() -> None:
    host = DecodeInputs.pack([11, 12, 13], [5, 9, 2], [3, 1, 2], [40, 41, 42], padded_bs=4, width=8)
    assert (host.bs, host.padded_bs) == (3, 4)
    assert host.ints.dtype == torch.int64 and host.ints.shape == (4, 8)
    assert host.ints[:, :4].tolist() == [[11, 12, 13, 0], [5, 9, 2, 0], [3, 1, 2, 0], [40, 41, 42, 0]]
    assert host.lens.dtype == torch.int32 and host.lens[:, :4].tolist() == [[6, 10, 3, 1], [5, 9, 2, 0]]
    assert host.seq_lens_cpu == [6, 10, 3, 1] and host.prefix_lens_cpu == [5, 9, 2, 0]
    with pytest.raises(ValueError, match="cannot be padded"):
        DecodeInputs.pack([1, 2], [0, 0], [0, 1], [1, 2], padded_bs=1)


def test_buffers_write_only_real_rows_and_build_padded_batch() -> None:
    req_pool = ReqToTokenPool(4, 16, "cpu")
    kv_pool = TokenToKVPool(32, 1, 1, 8, torch.float32, "cpu")
    backend = TorchNativeBackend.__new__(TorchNativeBackend)
    req_pool.req_to_token[0, 0] = 7  # row 0 belongs to a live request: padding must not touch it
    host = DecodeInputs.pack([11, 12, 13], [5, 9, 2], [3, 1, 2], [20, 21, 22], padded_bs=4, width=8)
    dev = DecodeBuffers.allocate(8, torch.device("cpu"))
    dev.fill(host)
    dev.write_req_to_token(req_pool.req_to_token, host.bs)
    table = req_pool.req_to_token
    assert (table[3, 5].item(), table[1, 9].item(), table[2, 2].item(), table[0, 0].item()) == (20, 21, 22, 7)
    assert int((table != 0).sum()) == 4
    batch = dev.forward_batch(host, req_pool, kv_pool, backend)
    assert batch.mode == ForwardMode.DECODE and batch.batch_size == 4 and batch.num_tokens == 4
    assert batch.out_cache_loc.tolist() == [20, 21, 22, 0] and batch.positions.tolist() == [5, 9, 2, 0]
    assert batch.seq_lens.dtype == torch.int32 and batch.seq_lens.tolist() == [6, 10, 3, 1]
    assert batch.extend_lens.tolist() == [1] * 4 and batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.extend_lens_cpu == [1] * 4
    eager = DecodeBuffers.upload(DecodeInputs.pack([5], [0], [1], [3], padded_bs=1), torch.device("cpu"))
    assert eager.ints.shape == (4, 1) and eager.logits_indices.tolist() == [0]


def test_can_run_and_backend_requirement() -> None:
    graphs = CudaGraphRunner.__new__(CudaGraphRunner)  # host-side checks only, no capture
    graphs.sizes = [1, 2, 4, 8]
    assert graphs.can_run(ForwardMode.DECODE, 1) and graphs.can_run(ForwardMode.DECODE, 8)
    assert not graphs.can_run(ForwardMode.DECODE, 9)
    assert not graphs.can_run(ForwardMode.EXTEND, 1) and not graphs.can_run(ForwardMode.PREFILL, 1)
    backend = TorchNativeBackend.__new__(TorchNativeBackend)
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        CudaGraphRunner(None, backend, None, None, [1], 1.0, torch.device("cpu"))  # type: ignore[arg-type]


def test_config_keys_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, **{"cuda_graph.max_bs": 32, "cuda_graph.batch_sizes": [1, 8, 32]})
    assert cfg.cuda_graph.enabled and cfg.cuda_graph.max_bs == 32 and cfg.cuda_graph.batch_sizes == [1, 8, 32]
    monkeypatch.setenv("RXF_CUDA_GRAPH__ENABLED", "false")
    assert not load_config().cuda_graph.enabled
    for bad in ({"cuda_graph.max_bs": 0}, {"cuda_graph.batch_sizes": []}, {"cuda_graph.batch_sizes": [0, 4]},
                {"cuda_graph.capture_budget_s": 0}, {"cuda_graph.bogus": 1}):
        with pytest.raises(ConfigError, match="cuda_graph"):
            load_config(None, **bad)


def _req(rid: str, logprobs: bool, top: int = 0) -> Req:
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    return Req(PreparedRequest(rid, [1, 2], params, RequestOptions(return_logprob=logprobs, top_logprobs_num=top)))


class _LogitsRunner:
    """Just enough of a ModelRunner for StepExecutor: its forward returns fixed logits."""

    device = torch.device("cpu")
    vocab_size = 10
    pooling = None  # a generative model

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def forward_with_aux(self, inp) -> tuple[torch.Tensor, None]:
        return self.logits, None


def _decode_step(reqs: list[Req]) -> StepBatch:
    for i, r in enumerate(reqs):
        r.kv = KVHandle(i, None, torch.tensor([i + 1, i + 2]))
    n = len(reqs)
    return StepBatch(
        mode=ForwardMode.DECODE, reqs=reqs, rows=list(range(n)), prefix_lens=[2] * n, extend_lens=[1] * n, input_ids=[3] * n,
        prev_rows=[-1] * n, out_cache_loc=torch.arange(n) + 10, row_writes=[None] * n, sample=[True] * n,
        prompt_logits_from=[None] * n, banned_ids=[[] for _ in reqs],
    )


def test_step_packs_logprobs_in_one_readback_and_skips_them_when_unasked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: calls.append(1) or log_softmax(*a, **k))
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    steps = StepExecutor(_LogitsRunner(logits), background=False)
    result = steps.resolve(steps.launch(_decode_step([_req("a", False), _req("b", False), _req("c", False)])))
    assert result.next_ids == logits.argmax(-1).tolist() and result.logprobs == [None] * 3 and not calls

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    result = steps.resolve(steps.launch(_decode_step([_req("a", False), _req("b", True, top=3), _req("c", True)])))
    assert len(reads) == 1  # ids and logprobs come back in one transfer
    ids = result.next_ids
    assert ids == logits.argmax(-1).tolist() and result.logprobs[0] is None
    want_chosen, want_top = gather_logprobs(log_softmax(logits[1:], -1), torch.tensor(ids[1:]), [3, 0])
    assert [result.logprobs[1][0], result.logprobs[2][0]] == pytest.approx(want_chosen)
    assert [result.logprobs[1][1], result.logprobs[2][1]] == want_top and len(want_top[0]) == 3
