"""Video in OpenAI chat messages: a `video` / `video_url` part holding a list of frame URLs reaches a
LLaVA-OneVision model as the same video `/generate` gets through `video_data`; a lone video file URL
is a 400 (video files are not decoded). One `rxf launch` server on a tiny random OneVision
checkpoint."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from rxf.plugins.multimodal.tiny import make_llava_checkpoint

QUESTION = "What happens?"
PROMPT = f"<|im_start|>user\n<video>\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"  # the template's rendering


def frame_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


FRAMES = [frame_url(seed) for seed in range(4)]


@pytest.fixture(scope="module")
def ov_server(module_server_factory, tmp_path_factory):
    path = make_llava_checkpoint(tmp_path_factory.mktemp("onevision"), "llava_onevision", seed=3)
    return module_server_factory({"model.path": str(path)})


@pytest.fixture(scope="module")
def client(ov_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=ov_server.base_url, api_key="none", max_retries=0)


def chat(client: openai.OpenAI, part: dict) -> str:
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}],
    )
    return resp.choices[0].message.content


def test_chat_video_frames_equal_native_video_data(ov_server, client) -> None:
    body = {"text": PROMPT, "video_data": [FRAMES],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with ov_server.client() as http:
        native = http.post("/generate", json=body)
    assert native.status_code == 200, native.text
    expected = native.json()["text"]
    assert chat(client, {"type": "video", "video": FRAMES}) == expected
    assert chat(client, {"type": "video_url", "video_url": {"url": FRAMES}}) == expected


@pytest.mark.parametrize("part", [
    {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
    {"type": "video", "video": []},
    {"type": "video", "video": [FRAMES[0], 7]},
])
def test_video_part_that_is_not_a_frame_list_is_400(client, part) -> None:
    with pytest.raises(openai.BadRequestError, match="list of frame URLs"):
        chat(client, part)
