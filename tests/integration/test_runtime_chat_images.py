"""`Runtime.chat` with an `image_url` part (a data: URL), as /v1/chat/completions takes it, on a tiny
random LLaVA-1.5 checkpoint: greedy tokens against transformers, which renders the same conversation
with its own processor's chat template."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import torch
from PIL import Image

from rxf import Runtime
from rxf.plugins.multimodal.tiny import make_llava_checkpoint

QUESTION = "What is in the picture?"


def png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def hf_greedy(path, image: bytes, n: int) -> list[int]:
    # Not at import: AutoProcessor imports triton.
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_chat_image_url_matches_transformers(tmp_path) -> None:
    path = make_llava_checkpoint(tmp_path / "llava", "llava", seed=5)
    image = png(30, 40, seed=2)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    settings = {"model.path": str(path), "runtime.device": "cpu", "attention.backend": "torch_native",
                "cache.max_total_tokens": 4096, "runtime.cpu_threads": 1}
    with Runtime.from_config(None, **settings) as rt:
        out = rt.chat(messages, params)
        again = asyncio.run(rt.async_chat(messages, params))
    expected = hf_greedy(path, image, 5)
    assert out["output_ids"] == expected and again["output_ids"] == expected
    assert out["meta_info"]["prompt_tokens"] > 16  # the image alone is 16 tokens
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 8  # the image hits the cache
