"""Images over HTTP: OpenAI chat `image_url` parts (data: URLs) with the official client, native
`/generate` `image_data`, and 400s for corrupt, oversized or disallowed images. One `rxf launch`
server on a tiny random LLaVA-1.5 checkpoint."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from rxf.plugins.multimodal.tiny import make_llava_checkpoint

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
MAX_IMAGE_BYTES = 20_000
MAX_REQUEST_PIXELS = 2_400  # one 40 x 60 image, or three 28 x 28 ones (784 pixels each), not four


def png(h: int, w: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"), "llava", seed=5)


@pytest.fixture(scope="module")
def mm_server(module_server_factory, llava_dir):
    return module_server_factory({"model.path": str(llava_dir), "multimodal.max_image_bytes": MAX_IMAGE_BYTES,
                                  "multimodal.max_request_pixels": MAX_REQUEST_PIXELS})


def hf_greedy(path, image_bytes: bytes, n: int) -> list[int]:
    from transformers import AutoProcessor  # not at import: it imports triton (see tests/unit/test_llava.py)

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text=PROMPT, images=[Image.open(io.BytesIO(image_bytes)).convert("RGB")], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_native_generate_with_image_matches_transformers_and_hits_cache(mm_server, llava_dir) -> None:
    image = png(40, 60, seed=1)
    body = {"text": PROMPT, "image_data": base64.b64encode(image).decode(),
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with mm_server.client() as http:
        first = http.post("/generate", json=body)
        assert first.status_code == 200, first.text
        second = http.post("/generate", json=body | {"image_data": [data_url(image)]})  # a list, a data URL
    assert first.json()["output_ids"] == hf_greedy(llava_dir, image, 5)
    assert second.json()["output_ids"] == first.json()["output_ids"]
    meta = second.json()["meta_info"]
    assert meta["cached_tokens"] >= meta["prompt_tokens"] - 8  # everything up to the question's end


def test_openai_chat_with_data_url_image(mm_server) -> None:
    client = openai.OpenAI(base_url=mm_server.base_url, api_key="none")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(30, 30, seed=2))}},
        {"type": "text", "text": "What is in the picture?"},
    ]}]
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          max_tokens=4, temperature=0)
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens > 16  # the image alone is 16 tokens
    assert resp.usage.completion_tokens >= 1


def test_anthropic_image_block_is_the_chat_image(mm_server) -> None:
    """A base64 `image` block of /v1/messages reaches the multimodal path as the same image as an
    OpenAI data-URL part: the same prompt tokens and the same greedy reply; a corrupt one is a 400
    in Anthropic's shape."""
    import anthropic

    image = png(30, 30, seed=4)
    client = openai.OpenAI(base_url=mm_server.base_url, api_key="none")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "What is in the picture?"}]}])
    claude = anthropic.Anthropic(base_url=mm_server.url, api_key="none", max_retries=0)

    def block(data: str) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}

    msg = claude.messages.create(model=model, max_tokens=4, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        block(base64.b64encode(image).decode()), {"type": "text", "text": "What is in the picture?"}]}])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens > 16
    assert msg.usage.cache_read_input_tokens > 16  # the same image, by content: its prefix was cached
    assert "".join(b.text for b in msg.content) == chat.choices[0].message.content
    with pytest.raises(anthropic.BadRequestError, match="base64") as err:
        claude.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [block("!!!")]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (data_url(b"\x89PNG\r\n\x1a\n but not an image"), "cannot decode"),
        (data_url(png(200, 200, seed=3)), f"exceeds {MAX_IMAGE_BYTES} bytes"),
        ("http://127.0.0.1:9/cat.png", "not allowed"),
        ("file:///etc/hostname", "not allowed"),
        ("data:image/png;base64,!!!", "base64"),
    ],
)
def test_openai_bad_images_are_400(mm_server, url: str, reason: str) -> None:
    client = openai.OpenAI(base_url=mm_server.base_url, api_key="none")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "hi"}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=2)
    assert reason in str(err.value)


def test_native_bad_image_data_is_400(mm_server) -> None:
    with mm_server.client() as http:
        resp = http.post("/generate", json={"text": PROMPT, "image_data": "not base64 at all!"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "image_data[0]", resp.text
        resp = http.post("/generate", json={"text": "no placeholder here", "image_data": [data_url(png(28, 28, 0))]})
        assert resp.status_code == 400 and "1 images for 0 image placeholders" in resp.text
        # The server is still healthy afterwards.
        assert http.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_placeholder_without_image_is_400_and_text_only_prompts_work(mm_server) -> None:
    with mm_server.client() as http:
        resp = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
        assert resp.status_code == 400 and "0 images for 1 image placeholders" in resp.text
        resp = http.post("/generate", json={"text": "just text", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 2


def test_a_request_past_its_pixel_budget_is_400_at_the_image_that_crosses_it(mm_server) -> None:
    # Each image within its own limits; together past multimodal.max_request_pixels (16 images of
    # 40M pixels each took 5 GB of the server's memory before this budget).
    prompt = PROMPT.replace("<image>", "<image>" * 4)
    images = [data_url(png(28, 28, seed)) for seed in range(4)]
    with mm_server.client() as http:
        resp = http.post("/generate", json={"text": prompt, "image_data": images, "sampling_params": {"max_new_tokens": 1}})
        assert resp.status_code == 400, resp.text
        assert "image_data[3]: the request's images and video frames exceed 2400 decoded pixels" in resp.text
        three = PROMPT.replace("<image>", "<image>" * 3)
        resp = http.post("/generate", json={"text": three, "image_data": images[:3], "sampling_params": {"max_new_tokens": 1}})
        assert resp.status_code == 200, resp.text
