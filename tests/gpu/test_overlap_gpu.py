"""Overlap scheduling on the GPU changes no output (skipped without CUDA): the step workload
(`rxf.testing.step_workload`: stop strings and tokens, EOS, JSON with jump-forward, `n` choices, an
abort mid-stream, retraction under a small pool, chunked and mixed prefill) through `Runtime` with
CUDA graphs, overlap off and on, on the triton backend in float32 (exact greedy equality is a
float32 property: the two runs batch differently; FlashInfer has no float32 kernels).
"""

from __future__ import annotations

import json

import pytest
import torch

from rxf import Runtime
from rxf.testing import make_tiny_checkpoint
from rxf.testing.step_workload import run_step_workload, stop_points

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY_GPU = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 1024, "num_hidden_layers": 2}
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"the_first_very_long_property_name": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["the_first_very_long_property_name"], "additionalProperties": False,
})
# Decode retracts only in a pool this small. A keyword override outranks the RXF_* environment, the
# config dict does not: gpu_session.sh's suite stage sets RXF_CACHE__MAX_TOTAL_TOKENS=65536, which
# gave this test a pool that never ran out (no retraction: the test failed there).
POOL = {"cache.max_total_tokens": 240}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-overlap"), "LlamaForCausalLM", seed=3, **TINY_GPU)


def _config(path, backend: str, overlap: bool) -> dict:
    return {
        "model": {"path": str(path), "dtype": "float32"},
        "runtime": {"device": "cuda"},
        "attention": {"backend": backend},
        "scheduler": {"overlap": overlap, "chunked_prefill_size": 16, "max_running_requests": 8,
                      "init_new_token_ratio": 0.05, "min_new_token_ratio": 0.05},
        "cuda_graph": {"max_bs": 8},
    }


def test_overlap_on_the_gpu_changes_no_output(tiny):
    backend = "triton"
    runs = {}
    for overlap in (False, True):
        with Runtime.from_config(_config(tiny, backend, overlap), **POOL) as rt:
            assert rt.engine.info["device"].startswith("cuda")
            if not runs:
                stops = stop_points(rt)
            runs[overlap] = run_step_workload(rt, *stops, SCHEMA)
    for key in [k for k in runs[False] if k not in ("stats", "aborted")]:
        assert runs[True][key] == runs[False][key], key
    for run in runs.values():
        assert run["stats"].extra["retractions"] > 0, "the pool was meant to be too small"
        assert run["stats"].extra["jump_forward_tokens"] > 0
        assert 5 <= len(run["aborted"]) < 60
