"""LLaVA-NeXT and OneVision on a GPU (skipped without CUDA): the engine's greedy tokens against
transformers' on the same device (fp32), each attention backend, image cache hits included."""

from __future__ import annotations

from unittest import mock

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
from rxf.plugins.multimodal.llava import LlavaProcessor
from rxf.plugins.multimodal.tiny import make_llava_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
# head_dim 64: the smallest the GPU backends compile for.
TEXT = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 512}


def image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_greedy_matches_hf_on_gpu(tmp_path, family: str, backend: str) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = make_llava_checkpoint(tmp_path / family, family, seed=2, text=TEXT)
    config = load_config({"model": {"path": str(path), "dtype": "float32"}, "runtime": {"device": "cuda"},
                          "attention": {"backend": backend}, "cache": {"max_total_tokens": 8192}})
    try:
        runner = ModelRunner(config, PluginRegistry.load(), str(path))
    except Exception as exc:  # e.g. flashinfer not installed
        pytest.skip(f"{backend}: {exc}")
    tok = AutoTokenizer.from_pretrained(path)
    proc = LlavaProcessor(str(path), config.multimodal, runner.vocab_size)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda().eval()
    sched = Scheduler(config, runner, tok, check_memory=True)
    # Both stop at the checkpoint's EOS ids (config + generation_config), so a random model may stop early.
    params = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0.0})
    tower = mock.Mock(wraps=runner.model.vision_tower.forward)
    with mock.patch.object(runner.model.vision_tower, "forward", tower):
        for i, img in enumerate([image(40, 70, 1), image(70, 40, 2), image(40, 70, 1)]):
            ids, items = proc.process(tok.encode(PROMPT), [img], None)
            sched.add_request(PreparedRequest(f"r{i}", ids, params, mm_items=items))
            got, cached = [], 0
            while sched.has_work:
                for out in sched.step():
                    got += out.new_token_ids
                    cached = out.cached_tokens
            hf_in = {k: torch.as_tensor(v).cuda() for k, v in _hf_inputs(proc, runner, ids, items, [img]).items()}
            with torch.inference_mode():
                ref = hf.generate(**hf_in, max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
            assert got == ref
            if i == 2:  # the first image again
                assert cached >= items[0].offset + items[0].length
    assert tower.call_count == 2


def _hf_inputs(proc, runner, ids, items, images) -> dict:
    ids = list(ids)
    for item in items:
        ids[item.offset : item.offset + item.length] = [runner.hf_config.image_token_id] * item.length
    out = proc.hf(text="<image>", images=images, return_tensors="pt")
    inputs = {"input_ids": torch.tensor([ids])}
    for key in ("pixel_values", "image_sizes", "batch_num_images"):
        if key in out:
            inputs[key] = out[key]
    return inputs
