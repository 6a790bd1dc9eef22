"""Video in OpenAI chat messages: a `video` / `video_url` part holding a list of frame URLs reaches a
LLaVA-OneVision model as the same video `/generate` gets through `video_data`. A video *file* (one
data URL, in chat or in `video_data`) is decoded and sampled to `multimodal.video_num_frames`
frames: it gives the greedy tokens of those frames sent as a frame list (the reference, decoded here
with plain PyAV), and repeating it hits the radix cache. Bad files are 400s naming the field. One
`rxf launch` server on a tiny random OneVision checkpoint."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import openai
import pytest
from PIL import Image

from rxf.plugins.multimodal.tiny import make_llava_checkpoint
from rxf.testing.videos import make_video

QUESTION = "What happens?"
PROMPT = f"<|im_start|>user\n<video>\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"  # the template's rendering


def png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def frame_url(seed: int) -> str:
    return png_url(Image.fromarray(np.random.default_rng(seed).integers(0, 256, (28, 28, 3), dtype=np.uint8)))


FRAMES = [frame_url(seed) for seed in range(4)]
VIDEO = make_video(24, width=40, height=30, keyframe_interval=4)  # mpeg4 in mp4; frames 8 and 20 are reached by seeks
VIDEO_URL = "data:video/mp4;base64," + base64.b64encode(VIDEO).decode()


def sampled_frame_urls() -> list[str]:
    """The reference: every frame decoded in order, then the 16 (the default video_num_frames)
    nearest to evenly spaced points from the first to the last, as lossless PNG frames."""
    with av.open(io.BytesIO(VIDEO)) as container:
        frames = [f.to_image() for f in container.decode(video=0)]
    picked = [round(i * (len(frames) - 1) / 15) for i in range(16)]
    return [png_url(frames[i]) for i in picked]


@pytest.fixture(scope="module")
def ov_server(module_server_factory, tmp_path_factory):
    path = make_llava_checkpoint(tmp_path_factory.mktemp("onevision"), "llava_onevision", seed=3)
    return module_server_factory({"model.path": str(path)})


@pytest.fixture(scope="module")
def client(ov_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=ov_server.base_url, api_key="none", max_retries=0)


def chat(client: openai.OpenAI, part: dict, **kwargs) -> str:
    return chat_response(client, part, **kwargs).choices[0].message.content


def chat_response(client: openai.OpenAI, part: dict, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}], **kwargs,
    )


def test_chat_video_frames_equal_native_video_data(ov_server, client) -> None:
    body = {"text": PROMPT, "video_data": [FRAMES],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with ov_server.client() as http:
        native = http.post("/generate", json=body)
    assert native.status_code == 200, native.text
    expected = native.json()["text"]
    assert chat(client, {"type": "video", "video": FRAMES}) == expected
    assert chat(client, {"type": "video_url", "video_url": {"url": FRAMES}}) == expected


def test_video_file_gives_the_tokens_of_its_sampled_frames_and_hits_the_cache(ov_server, client) -> None:
    first = chat_response(client, {"type": "video_url", "video_url": {"url": VIDEO_URL}}, logprobs=True)
    second = chat_response(client, {"type": "video_url", "video_url": {"url": VIDEO_URL}}, logprobs=True)
    reference = chat_response(client, {"type": "video", "video": sampled_frame_urls()}, logprobs=True)
    tokens = [[t.token for t in r.choices[0].logprobs.content] for r in (first, second, reference)]
    assert tokens[0] == tokens[2] and tokens[1] == tokens[2] and len(tokens[0]) >= 1
    assert first.usage.prompt_tokens == reference.usage.prompt_tokens > 16  # 16 frames, >= 1 token each
    # Same file, same frames, same content hash: the repeat reuses the video's KV from the radix cache,
    # and so do the reference's frames (the decoder's seeks give the frames a plain decode gives).
    for repeat in (second, reference):
        assert repeat.usage.prompt_tokens_details.cached_tokens >= repeat.usage.prompt_tokens - 8
    body = {"text": PROMPT, "video_data": VIDEO_URL, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with ov_server.client() as http:
        native = http.post("/generate", json=body)  # natively: one video file instead of a frame list
    assert native.status_code == 200, native.text
    assert native.json()["text"] == reference.choices[0].message.content


@pytest.mark.parametrize("part", [
    {"type": "video", "video": []},
    {"type": "video", "video": [FRAMES[0], 7]},
    {"type": "video_url", "video_url": {"url": 7}},
])
def test_video_part_that_is_neither_a_file_nor_a_frame_list_is_400(client, part) -> None:
    with pytest.raises(openai.BadRequestError, match="a video file URL or a non-empty list of frame URLs"):
        chat(client, part)


@pytest.mark.parametrize(("url", "reason"), [
    ("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode(), "cannot decode the video"),
    ("data:video/mp4;base64," + base64.b64encode(VIDEO[: len(VIDEO) // 3]).decode(), "cannot decode the video"),
    ("https://example.com/clip.mp4", "http(s) video URLs are not allowed (multimodal.allow_urls)"),
    ("file:///etc/hostname", "local video paths are not allowed (multimodal.allow_local_paths)"),
])
def test_bad_video_file_is_400_naming_the_field(client, url: str, reason: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, {"type": "video_url", "video_url": {"url": url}})
    assert err.value.status_code == 400 and "messages: video[0]: " in str(err.value) and reason in str(err.value)


def test_native_bad_video_file_is_400_and_the_server_stays_healthy(ov_server) -> None:
    with ov_server.client() as http:
        resp = http.post("/generate", json={"text": PROMPT, "video_data": "data:video/mp4;base64,AAAAGGZ0eXA="})
        assert resp.status_code == 400 and "video_data[0]: cannot decode the video" in resp.text, resp.text
        ok = http.post("/generate", json={"text": PROMPT, "video_data": [VIDEO_URL],
                                          "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_two_videos_of_different_lengths_in_one_request(ov_server) -> None:
    # Shorter than video_num_frames, each keeps all its frames: 2 and 3 here. The stand-in processor
    # stacked the clips into one tensor and refused them ("image_data: preprocessing failed").
    prompt = PROMPT.replace("<video>", "<video><video>")
    body = {"text": prompt, "video_data": [FRAMES[:2], FRAMES[:3]], "sampling_params": {"max_new_tokens": 2}}
    with ov_server.client() as http:
        both = http.post("/generate", json=body)
        assert both.status_code == 200, both.text
        one = http.post("/generate", json={**body, "text": PROMPT, "video_data": [FRAMES[:2]]})
        other = http.post("/generate", json={**body, "text": PROMPT, "video_data": [FRAMES[:3]]})
    both_n, two_n, three_n = (r.json()["meta_info"]["prompt_tokens"] for r in (both, one, other))
    # A video of f frames is f runs of a frame's pooled tokens + 1 (transformers' rule): the second
    # video adds 3 frames' tokens + 1, and one frame's tokens are what 3 frames add over 2.
    assert both_n - two_n == 3 * (three_n - two_n) + 1, (both_n, two_n, three_n)
