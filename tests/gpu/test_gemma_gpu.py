"""Gemma 2 / Gemma 3 on a GPU (skipped without CUDA).

- Text: greedy tokens through the engine (in-process Scheduler, CUDA graphs on, prefill chunks of
  24 tokens) with local windows of 16 under prompts of 40-120 tokens and soft-caps (Gemma 2:
  attention scores and final logits; Gemma 3: final logits, q/k norms, another rope on its global
  layer), on triton in float32 and flashinfer in bfloat16, scored as tests/gpu/test_cuda_graph_gpu.py
  scores Llama (float32: every gap to transformers' argmax rounding-small; bf16: within 1.5x of
  transformers' own bf16 greedy tokens' gap).
- Gemma 3 with images on triton in float32: the image tokens' bidirectional attention is
  recomputed over the GPU backend's KV pool; the tokens score against transformers' image model
  (its `token_type_ids` mask) the same way.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from test_cuda_graph_gpu import (  # noqa: E402
    FP32_GAP,
    _assert_as_faithful_as_transformers,
    _available_backends,
    _config,
    _registry,
    _scheduler_greedy,
)

from rxf.core.ipc.messages import PreparedRequest  # noqa: E402
from rxf.core.runner.model_runner import ModelRunner  # noqa: E402
from rxf.core.sampling_params import SamplingParams  # noqa: E402
from rxf.core.scheduler.scheduler import Scheduler  # noqa: E402
from rxf.testing import make_tiny_checkpoint  # noqa: E402

# head_dim 64 (the smallest both GPU backends compile for) != hidden / heads = 32; GQA 8 / 2.
# Init 0.02: Gemma scales embeddings by sqrt(hidden), and larger inits make greedy repeat one token.
SHAPE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "intermediate_size": 512, "sliding_window": 16, "tie_word_embeddings": True, "initializer_range": 0.02}
MODELS = {
    "gemma2": ("Gemma2ForCausalLM", {
        **SHAPE, "query_pre_attn_scalar": 48, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 3.0,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
    "gemma3": ("Gemma3ForCausalLM", {
        **SHAPE, "query_pre_attn_scalar": 64, "final_logit_softcapping": 3.0, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
    }),
}
CASES = [(b, d) for b, d in [("triton", torch.float32), ("flashinfer", torch.bfloat16)] if b in _available_backends()]
CHUNK = {"scheduler.chunked_prefill_size": 24, "cache.max_total_tokens": 8192}
NEW_TOKENS = 32


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
@pytest.mark.parametrize("name", list(MODELS))
def test_text_greedy_matches_transformers(tmp_path, name: str, backend: str, dtype: torch.dtype) -> None:
    arch, overrides = MODELS[name]
    path = make_tiny_checkpoint(tmp_path / name, arch, seed=6, **overrides)
    config = _config(path, backend, dtype, graphs=True, **CHUNK)
    runner = ModelRunner(config, _registry(), str(path))
    assert runner.cuda_graphs is not None
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(40, 120))] for _ in range(5)]
    tokens = _scheduler_greedy(config, runner, path, prompts, NEW_TOKENS)
    _assert_as_faithful_as_transformers(path, prompts, tokens, dtype)


def _image(h: int, w: int, seed: int) -> Image.Image:
    grid = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)  # features of its own
    return Image.fromarray(grid).resize((w, h), Image.NEAREST)


@pytest.mark.skipif("triton" not in _available_backends(), reason="triton is not available")
def test_gemma3_images_greedy_matches_transformers(tmp_path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from rxf.plugins.multimodal.gemma3 import Gemma3Processor
    from rxf.plugins.multimodal.tiny import make_gemma3_checkpoint

    text = {**SHAPE, "sliding_window": 12, "query_pre_attn_scalar": 64}  # the 16 image tokens cross the window
    path = make_gemma3_checkpoint(tmp_path / "gemma3-vision", seed=3, text=text)
    config = _config(path, "triton", torch.float32, graphs=True, **CHUNK)
    runner = ModelRunner(config, _registry(), str(path))
    tok = AutoTokenizer.from_pretrained(path)
    proc = Gemma3Processor(str(path), config.multimodal, runner.vocab_size)
    prompt = "<|im_start|>user\nCompare <start_of_image> with<start_of_image>, please.<|im_end|>\n<|im_start|>assistant\n"
    images = [[_image(40, 70, 1), _image(70, 40, 2)], [_image(40, 70, 1), _image(50, 50, 3)]]  # the first is shared
    sched = Scheduler(config, runner, tok, check_memory=True)
    params = SamplingParams.from_dict({"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
    requests = [proc.process(tok.encode(prompt), imgs, None) for imgs in images]
    for i, (ids, items) in enumerate(requests):
        sched.add_request(PreparedRequest(f"r{i}", ids, params, mm_items=items))
    got: dict[str, list[int]] = {}
    while sched.has_work:
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for i, (imgs, (ids, _)) in enumerate(zip(images, requests, strict=True)):
        tokens = got[f"r{i}"]
        inputs: dict[str, Any] = {k: v.cuda() for k, v in proc.hf(text=prompt, images=imgs, return_tensors="pt").items()}
        assert inputs["input_ids"].shape[1] == len(ids)
        new = torch.tensor([tokens], device="cuda")
        with torch.inference_mode():  # the prompt's image tokens bidirectional, the new tokens causal
            logits = hf(input_ids=torch.cat([inputs["input_ids"], new], 1), pixel_values=inputs["pixel_values"],
                        token_type_ids=torch.cat([inputs["token_type_ids"], torch.zeros_like(new)], 1),
                        attention_mask=torch.cat([inputs["attention_mask"], torch.ones_like(new)], 1)).logits[0]
        logits = logits[len(ids) - 1 : -1].float()
        best = logits.max(dim=-1).values
        gaps = (best - logits.gather(1, new.view(-1, 1)).view(-1)) / best.abs()
        assert len(tokens) == NEW_TOKENS and gaps.max() <= FP32_GAP, f"request {i}: relative gaps {gaps.tolist()}"
