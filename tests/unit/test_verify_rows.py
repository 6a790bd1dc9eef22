"""A short extend (a speculative verify, a draft's catch-up) runs as DECODE rows where a CUDA graph
holds them (`ModelRunner._extend_rows`): the logits the extend asks for, as the extend gives
them, for every backend that says `verifies_as_decode`, windowed layers included. On the CPU there
are no graphs: the tests let the rows run eagerly (`_replays`), the computation a replay does on the
GPU (tests/gpu/test_spec_graphs_gpu.py replays it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rxf.core.forward import ForwardMode
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.plugins.attention.cpu import COMPILE_ENV
from rxf.testing import make_tiny_checkpoint
from rxf.testing.model_harness import ModelHarness

PROMPTS = [[5, 80, 17, 9, 33, 2, 41], [400, 12, 7, 7, 90, 3, 11, 19, 260, 5, 6, 8]]
NEW = [[21, 22, 23, 24], [30]]  # request 0: newest token + 3 drafts; request 1: no drafts


@pytest.fixture(scope="module", params=[None, 6], ids=["full", "window6"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = "LlamaForCausalLM" if request.param is None else "MistralForCausalLM"
    extra = {} if request.param is None else {"sliding_window": request.param}
    return make_tiny_checkpoint(tmp_path_factory.mktemp("verify"), arch, **extra)


def _prefill(runner: ModelRunner) -> tuple[list[int], list[int]]:
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    rows = [runner.req_to_token_pool.alloc() for _ in PROMPTS]
    slots = torch.cat([runner.token_to_kv_pool.alloc(len(p)) for p in PROMPTS])
    runner.forward(ModelInput(ForwardMode.PREFILL, rows, [t for p in PROMPTS for t in p], [0, 0],
                              [len(p) for p in PROMPTS], slots))
    return rows, [len(p) for p in PROMPTS]


def _verify(runner: ModelRunner, rows: list[int], prefix: list[int], slots: torch.Tensor,
            logits_start: list[int] | None) -> torch.Tensor:
    inp = ModelInput(ForwardMode.EXTEND, rows, [t for n in NEW for t in n], prefix, [len(n) for n in NEW], slots,
                     logits_start=logits_start)
    return runner.forward(inp)


# A verify (every new token's logits), a catch-up (each request's last), and some of request 0's.
LOGITS = {"verify": ([0, 0], 5), "last": (None, 2), "from 2": ([2, 0], 3)}


@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
@pytest.mark.parametrize("logits", LOGITS)
def test_a_short_extend_as_decode_rows_gives_the_extends_logits(
    ckpt: Path, backend: str, logits: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits_start, num_logits = LOGITS[logits]
    monkeypatch.setenv(COMPILE_ENV, "startup")  # the cpu backend's own decode kernel, not its fallback
    runner = ModelHarness(ckpt, attention_backend=backend).runner
    assert runner.attn_backend.verifies_as_decode and not runner._replays(5)
    monkeypatch.setattr(runner, "_replays", lambda rows: True)
    rows, prefix = _prefill(runner)
    slots = runner.token_to_kv_pool.alloc(sum(map(len, NEW)))
    decodes = []
    real = runner._forward_decode
    monkeypatch.setattr(runner, "_forward_decode", lambda inp, logits_rows=None: decodes.append(inp) or real(inp, logits_rows))
    with torch.inference_mode():
        as_rows = _verify(runner, rows, prefix, slots, logits_start)
        assert len(decodes) == 1 and decodes[0].req_pool_indices == [rows[0]] * 4 + [rows[1]]
        assert decodes[0].prefix_lens == [7, 8, 9, 10, 12]
        monkeypatch.setattr(runner.attn_backend, "verifies_as_decode", False)
        as_extend = _verify(runner, rows, prefix, slots, logits_start)  # the same tokens into the same slots
    assert len(decodes) == 1
    assert as_rows.shape == as_extend.shape == (num_logits, runner.vocab_size)
    torch.testing.assert_close(as_rows, as_extend, rtol=1e-5, atol=1e-5)
    # And the rows' positions wrote req_to_token as the extend does.
    table = runner.req_to_token_pool.req_to_token
    assert table[rows[0], 7:11].tolist() == slots[:4].tolist() and table[rows[1], 12].item() == slots[4].item()


def test_which_extends_become_decode_rows(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short extend that a CUDA graph holds; any extend once the CPU's decode forward is compiled
    for the thread count (`tests/unit/test_compiled_decode.py` runs them)."""
    runner = ModelHarness(ckpt, **{"speculative.num_draft_tokens": 3}).runner
    inp = ModelInput(ForwardMode.EXTEND, [1, 2], [1] * 5, [7, 12], [4, 1], torch.arange(5))
    assert runner._extend_rows(inp) is None  # no graph holds them
    monkeypatch.setattr(runner, "_replays", lambda rows: True)
    assert runner._extend_rows(inp) is not None
    longer = ModelInput(ForwardMode.EXTEND, [1, 2], [1] * 6, [7, 12], [5, 1], torch.arange(6))  # 5 > 3 drafts + 1
    assert runner._extend_rows(longer) is None
    # A backend whose decode cannot carry several rows of one request (the triton backend storing K/V
    # inside its decode launch) still takes an extend of one token a request as decode rows.
    monkeypatch.setattr(runner.attn_backend, "verifies_as_decode", False)
    assert runner._extend_rows(inp) is None
    assert runner._extend_rows(ModelInput(ForwardMode.EXTEND, [1, 2], [1] * 2, [7, 12], [1, 1], torch.arange(2)))
    monkeypatch.setattr(runner.attn_backend, "verifies_as_decode", True)

    class Compiled:
        def ready_for(self, threads: int) -> bool:
            return threads == 1

    monkeypatch.setattr(runner, "compiled_decode", Compiled())
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert runner._extend_rows(longer) is not None
        torch.set_num_threads(2)
        assert runner._extend_rows(longer) is None  # no graphs for this count yet
    finally:
        torch.set_num_threads(saved)


def test_decode_batches_hold_several_rows_of_a_request_only_when_speculating(ckpt: Path) -> None:
    """What the runner tells its attention backend (`AttentionContext.multi_row_decode`): a target that
    speculates verifies as decode rows; a plain one never puts two rows of a request in a decode batch."""
    assert not ModelHarness(ckpt).runner._attention_context.multi_row_decode
    spec = ModelHarness(ckpt, **{"speculative.method": "ngram"}).runner
    assert spec._attention_context.multi_row_decode
