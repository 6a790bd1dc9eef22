"""Gemma 3 with images over HTTP: one `rxf launch` server on a tiny random Gemma 3 checkpoint,
prefill chunks of 8 tokens (smaller than an image's 16), native `/generate` against transformers
(bidirectional image attention) with a cache hit on the second request, and an OpenAI chat
`image_url` part through the official client."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from rxf.plugins.multimodal.tiny import make_gemma3_checkpoint

PROMPT = "<|im_start|>user\n<start_of_image>What is in the picture?<|im_end|>\n<|im_start|>assistant\n"


def png(h: int, w: int, seed: int) -> bytes:
    """A 4x4 grid of random colours (pixel noise would give every image nearly the same features)."""
    grid = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(grid).resize((w, h), Image.NEAREST).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"), seed=5)


@pytest.fixture(scope="module")
def gemma3_server(module_server_factory, gemma3_dir):
    return module_server_factory({"model.path": str(gemma3_dir), "scheduler.chunked_prefill_size": 8})


@torch.inference_mode()
def hf_greedy(path, image_bytes: bytes, n: int) -> list[int]:
    """Full forwards: the prompt's image tokens bidirectional (token_type_ids), new tokens causal."""
    from transformers import AutoProcessor  # not at import: it imports triton (see tests/unit/test_llava.py)

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    image = Image.open(io.BytesIO(image_bytes)).convert("RGB")
    inputs = dict(processor(text=PROMPT, images=[image], return_tensors="pt"))
    out: list[int] = []
    for _ in range(n):
        out.append(int(model(**inputs).logits[0, -1].argmax()))
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[out[-1]]])], dim=1)
        inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.tensor([[0]])], dim=1)
        inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.tensor([[1]])], dim=1)
    return out


def test_native_generate_with_image_matches_transformers_and_hits_cache(gemma3_server, gemma3_dir) -> None:
    image = png(40, 60, seed=1)
    body = {"text": PROMPT, "image_data": base64.b64encode(image).decode(),
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with gemma3_server.client() as http:
        first = http.post("/generate", json=body)
        assert first.status_code == 200, first.text
        second = http.post("/generate", json=body | {"image_data": [data_url(image)]})
    assert first.json()["output_ids"] == hf_greedy(gemma3_dir, image, 5)
    assert second.json()["output_ids"] == first.json()["output_ids"]
    meta = second.json()["meta_info"]
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1  # all but the last prompt token


def test_openai_chat_with_image_url(gemma3_server) -> None:
    client = openai.OpenAI(base_url=gemma3_server.base_url, api_key="none")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(30, 30, seed=2))}},
        {"type": "text", "text": "What is in the picture?"},
    ]}]
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens > 16 + 4  # the image's tokens, boi, eoi and blank lines
    assert resp.usage.completion_tokens >= 1


def test_placeholder_without_image_and_video_are_400(gemma3_server) -> None:
    with gemma3_server.client() as http:
        resp = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
        assert resp.status_code == 400 and "0 images for 1 image placeholders" in resp.text
        resp = http.post("/generate", json={"text": PROMPT, "image_data": [data_url(png(28, 28, 0))],
                                            "video_data": [[data_url(png(28, 28, 1))]]})
        assert resp.status_code == 400 and "Gemma 3 takes images only" in resp.text
        assert http.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
