"""LLaVA-OneVision (SigLIP + Qwen2) on a tiny random checkpoint, against transformers: one anyres
image, two images in one prompt (no anyres then), a 4-frame video, and images with a video.

The reference model gets the very tensors the checkpoint's processor produces (transformers'
`LlavaOnevisionProcessor` when torchvision is installed, else rxf's stand-in built on the same image
processor and transformers' own token-count rule) and the prompt with its image tokens restored.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.plugins.multimodal.llava import LlavaProcessor
from rxf.plugins.multimodal.tiny import make_llava_checkpoint


def image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def prompt(*placeholders: str) -> str:
    return f"<|im_start|>user\n{''.join(p + chr(10) for p in placeholders)}Compare them.<|im_end|>\n<|im_start|>assistant\n"


CASES = {
    "one_image": (prompt("<image>"), [image(40, 70, 1)], []),
    "two_images": (prompt("<image>", "<image>"), [image(40, 70, 2), image(50, 30, 3)], []),
    "video": (prompt("<video>"), [], [[image(32, 48, 10 + i) for i in range(4)]]),
    "image_and_video": (prompt("<image>", "<video>"), [image(60, 28, 4)], [[image(32, 48, 20 + i) for i in range(4)]]),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = make_llava_checkpoint(tmp_path_factory.mktemp("onevision"), "llava_onevision", seed=7)
    config = load_config(
        {"model": {"path": str(path)}, "runtime": {"device": "cpu"}, "attention": {"backend": "torch_native"},
         "cache": {"max_total_tokens": 4096}}
    )
    runner = ModelRunner(config, PluginRegistry.load(), str(path))
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    proc = LlavaProcessor(str(path), config.multimodal, runner.vocab_size)
    return config, runner, hf, proc, AutoTokenizer.from_pretrained(path)


def hf_inputs(env, text: str, images, videos) -> dict:
    """The reference's inputs: the processor's tensors for these items, the prompt expanded by it."""
    _, runner, _, proc, tok = env
    ids, items = proc.process(tok.encode(text), images, videos)
    cfg = runner.hf_config
    for item in items:
        token = cfg.image_token_id if item.modality == "image" else cfg.video_token_id
        ids[item.offset : item.offset + item.length] = [token] * item.length
    placeholders = " a ".join(["<image>"] * len(images) + ["<video>"] * len(videos))
    out = proc.hf(text=placeholders, images=images or None, videos=videos or None, return_tensors="pt")
    inputs = {"input_ids": torch.tensor([ids])}
    for key in ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos"):
        if key in out:
            inputs[key] = torch.as_tensor(out[key])
    return inputs


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(env, case: str) -> None:
    _, runner, hf, proc, tok = env
    text, images, videos = CASES[case]
    ids, items = proc.process(tok.encode(text), images, videos)
    assert [i.modality for i in items] == ["image"] * len(images) + ["video"] * len(videos)
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    row, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(ids))
    ours = runner.forward(
        ModelInput(ForwardMode.PREFILL, [row], ids, [0], [len(ids)], slots, logits_start=[0], mm_items=[items])
    )
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    with torch.inference_mode():
        ref = hf(**hf_inputs(env, text, images, videos)).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_greedy_matches_hf_and_repeat_skips_vision(env) -> None:
    config, runner, hf, proc, tok = env
    text, images, videos = CASES["image_and_video"]
    inputs = hf_inputs(env, text, images, videos)
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1] :].tolist()
    sched = Scheduler(config, runner, tok, check_memory=True)
    runner.model.feature_cache = type(runner.model.feature_cache)()  # the logits tests filled it
    tower = mock.Mock(wraps=runner.model.vision_tower.forward)
    params = SamplingParams.from_dict({"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    results = []
    with mock.patch.object(runner.model.vision_tower, "forward", tower):
        for rid in ("a", "b"):
            ids, items = proc.process(tok.encode(text), images, videos)
            sched.add_request(PreparedRequest(rid, ids, params, mm_items=items))
            out = {"ids": []}
            while sched.has_work:
                for o in sched.step():
                    out["ids"] += o.new_token_ids
                    out["cached"] = o.cached_tokens
            results.append(out)
    assert results[0]["ids"] == ref and results[1]["ids"] == ref
    assert tower.call_count == 1  # one call encodes the image and the frames together; none for "b"
    last = items[-1]
    assert results[1]["cached"] >= last.offset + last.length
