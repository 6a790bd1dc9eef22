"""Gemma 2 / Gemma 3 on a GPU (skipped without CUDA): the engine's greedy tokens against
transformers', with local windows of 16 under prompts of 40-120 tokens, soft-caps (Gemma 2:
attention and final logits; Gemma 3: final logits), chunked prefill and CUDA-graph decode, on
triton in float32 and flashinfer in bfloat16; and Gemma 3 with images (bidirectional image
attention over the GPU backends' KV pool) on triton in float32.

Tokens are scored teacher-forced as in test_cuda_graph_gpu.py: each of our tokens' gap to the
reference's top logit, relative to it. float32: rounding-small (our tokens are transformers'
greedy tokens). bfloat16: within 1.5x of transformers' own bf16 greedy tokens' worst gap.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from rxf.core.config import load_config
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.testing import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# head_dim 64 (the smallest both GPU backends compile for) != hidden / heads = 32; GQA 8 / 2.
SHAPE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "intermediate_size": 512, "sliding_window": 16, "tie_word_embeddings": True,
         "initializer_range": 0.02}  # Gemma scales embeddings by sqrt(hidden): larger inits repeat one token
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
CASES = [("triton", torch.float32), ("flashinfer", torch.bfloat16)]
FP32_GAP = 1e-4
NEW_TOKENS = 32


def _backend_or_skip(name: str) -> None:
    try:
        available = PluginRegistry.load().attention_backend(name).is_available(torch.device("cuda"))
    except Exception as exc:  # its kernel library is not installed here
        pytest.skip(f"{name}: {exc}")
    if not available:
        pytest.skip(f"{name} is not available on this GPU")


def _config(path: Path, backend: str, dtype: torch.dtype):
    return load_config({
        "model": {"path": str(path), "dtype": str(dtype).removeprefix("torch.")},
        "runtime": {"device": "cuda"},
        "attention": {"backend": backend},
        "scheduler": {"max_running_requests": 8, "chunked_prefill_size": 24},
        "cache": {"max_total_tokens": 8192},
        "cuda_graph": {"enabled": True, "batch_sizes": [1, 2, 4, 8]},
    })


def _run(sched: Scheduler, requests: list[tuple[list[int], Any]]) -> list[list[int]]:
    params = SamplingParams.from_dict({"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
    for i, (ids, items) in enumerate(requests):
        sched.add_request(PreparedRequest(f"r{i}", ids, params, mm_items=items))
    got: dict[str, list[int]] = {}
    while sched.has_work:
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(requests))]


def _worst_gap(logits_of: Any, prompt_len: int, tokens: list[int]) -> float:
    """max over steps of (top logit - logit of tokens[t]) / |top logit| in one reference forward
    over prompt + tokens (row prompt_len - 1 + t predicts tokens[t])."""
    logits = logits_of(tokens)[prompt_len - 1 : -1].float()
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(tokens, device=logits.device).view(-1, 1)).view(-1)
    return float(((best - chosen) / best.abs()).max())


@pytest.mark.parametrize(("backend", "dtype"), CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
@pytest.mark.parametrize("name", list(MODELS))
def test_text_greedy_matches_transformers(tmp_path, name: str, backend: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _backend_or_skip(backend)
    arch, overrides = MODELS[name]
    path = make_tiny_checkpoint(tmp_path / name, arch, seed=6, **overrides)
    config = _config(path, backend, dtype)
    runner = ModelRunner(config, PluginRegistry.load(), str(path))
    assert runner.cuda_graphs is not None
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(40, 120))] for _ in range(5)]
    got = _run(Scheduler(config, runner, AutoTokenizer.from_pretrained(path), check_memory=True),
               [(p, None) for p in prompts])

    models: dict[torch.dtype, Any] = {}

    def reference(ref_dtype: torch.dtype, prompt: list[int]) -> Any:
        if ref_dtype not in models:
            models[ref_dtype] = AutoModelForCausalLM.from_pretrained(path, dtype=ref_dtype).cuda().eval()
        model = models[ref_dtype]

        @torch.inference_mode()
        def logits_of(tokens: list[int]) -> torch.Tensor:
            return model(torch.tensor([prompt + tokens], device="cuda")).logits[0]
        return logits_of

    ours = [_worst_gap(reference(torch.float32, p), len(p), t) for p, t in zip(prompts, got, strict=True)]
    if dtype == torch.float32:
        assert max(ours) <= FP32_GAP, f"relative gaps to transformers' argmax per request: {ours}"
        return
    theirs = []
    for p in prompts:  # transformers' own bf16 greedy tokens, scored by its float32 logits
        logits_of = reference(dtype, p)
        seq: list[int] = []
        for _ in range(NEW_TOKENS):
            seq.append(int(logits_of(seq)[-1].argmax()))
        theirs.append(_worst_gap(reference(torch.float32, p), len(p), seq))
    assert max(ours) <= 1.5 * max(theirs) + 1e-3, f"worst relative gaps: rxf {ours}, transformers {theirs} (bf16)"


def _image(h: int, w: int, seed: int) -> Image.Image:
    grid = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((w, h), Image.NEAREST)


def test_gemma3_images_greedy_matches_transformers(tmp_path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from rxf.plugins.multimodal.gemma3 import Gemma3Processor
    from rxf.plugins.multimodal.tiny import make_gemma3_checkpoint

    _backend_or_skip("triton")
    text = {**SHAPE, "sliding_window": 12, "query_pre_attn_scalar": 64}  # the 16 image tokens cross the window
    path = make_gemma3_checkpoint(tmp_path / "gemma3-vision", seed=3, text=text)
    config = _config(path, "triton", torch.float32)
    runner = ModelRunner(config, PluginRegistry.load(), str(path))
    tok = AutoTokenizer.from_pretrained(path)
    proc = Gemma3Processor(str(path), config.multimodal, runner.vocab_size)
    prompt = "<|im_start|>user\nCompare <start_of_image> with<start_of_image>, please.<|im_end|>\n<|im_start|>assistant\n"
    images = [[_image(40, 70, 1), _image(70, 40, 2)], [_image(40, 70, 1), _image(50, 50, 3)]]
    requests = [proc.process(tok.encode(prompt), imgs, None) for imgs in images]
    got = _run(Scheduler(config, runner, tok, check_memory=True), requests)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for imgs, (ids, _), tokens in zip(images, requests, got, strict=True):
        inputs = {k: v.cuda() for k, v in proc.hf(text=prompt, images=imgs, return_tensors="pt").items()}
        assert inputs["input_ids"].shape[1] == len(ids)

        @torch.inference_mode()
        def logits_of(new: list[int], inputs=inputs) -> torch.Tensor:
            pad = torch.tensor([new], device="cuda", dtype=torch.long)
            zeros, ones = torch.zeros_like(pad), torch.ones_like(pad)
            return hf(input_ids=torch.cat([inputs["input_ids"], pad], 1), pixel_values=inputs["pixel_values"],
                      token_type_ids=torch.cat([inputs["token_type_ids"], zeros], 1),
                      attention_mask=torch.cat([inputs["attention_mask"], ones], 1)).logits[0]

        assert _worst_gap(logits_of, len(ids), tokens) <= FP32_GAP
