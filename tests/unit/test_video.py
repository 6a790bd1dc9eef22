"""Video files decoded with PyAV (`rxf.plugins.multimodal.video`): uniform sampling picks the expected
frames (told apart by colour) in several containers and codecs, keyframe seeks keep decoding within
`max_video_decoded_frames`, every bad file is a MediaError naming the field, and frame lists work as
before. The videos are encoded at test time (`rxf.testing.videos`)."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from PIL import Image

from rxf.core.config import MultimodalConfig
from rxf.plugins.multimodal import video
from rxf.plugins.multimodal.media import MediaError, PixelBudget
from rxf.plugins.multimodal.video import load_video, sample_indices
from rxf.testing.videos import frame_colour, frame_index, make_video

LIMITS = MultimodalConfig()


def indices(frames: list[Image.Image]) -> list[int]:
    return [frame_index(f) for f in frames]


def spread(total: int, n: int) -> list[int]:
    """The frames nearest to n evenly spaced points from the first frame to the last."""
    return [round(i * (total - 1) / (n - 1)) for i in range(n)] if total > n else list(range(total))


@pytest.mark.parametrize(("total", "n"), [(24, 16), (100, 16), (17, 16), (16, 16), (5, 16), (7, 1), (1, 3)])
def test_sample_indices_are_even_and_cover_the_video(total: int, n: int) -> None:
    picked = sample_indices(total, n)
    assert picked == (spread(total, n) if n > 1 else [0])
    assert len(picked) == min(total, n) and picked == sorted(set(picked))


@pytest.mark.parametrize(("codec", "container"), [("mpeg4", "mp4"), ("libvpx", "webm"), ("mjpeg", "avi"),
                                                  ("libx264", "mov"), ("mpeg4", "matroska")])
def test_video_file_gives_evenly_sampled_frames(codec: str, container: str) -> None:
    frames = load_video(make_video(24, codec=codec, container=container), LIMITS, "video_data[0]")
    assert LIMITS.video_num_frames == 16
    assert indices(frames) == spread(24, 16)
    assert all(f.mode == "RGB" and f.size == (64, 48) for f in frames)
    # Decoding is deterministic (the content hash, hence the radix cache, depends on it).
    again = load_video(make_video(24, codec=codec, container=container), LIMITS, "video_data[0]")
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(frames, again, strict=True))


def test_short_video_gives_all_frames_and_max_video_frames_caps_the_sample() -> None:
    assert indices(load_video(make_video(5), LIMITS, "v")) == [0, 1, 2, 3, 4]
    capped = MultimodalConfig(video_num_frames=16, max_video_frames=4)
    assert indices(load_video(make_video(24), capped, "v")) == [0, 8, 15, 23]


def test_keyframe_seeks_bound_decoding() -> None:
    # 4 frames of 24: with a keyframe every 6 frames, seeking decodes 1 + 3 (6..8) + 4 (12..15) +
    # 6 (18..23) = 14 frames; with one keyframe, sequential decoding needs all 24.
    limits = MultimodalConfig(video_num_frames=4, max_video_decoded_frames=14)
    assert indices(load_video(make_video(24, keyframe_interval=6), limits, "v")) == [0, 8, 15, 23]
    with pytest.raises(MediaError, match=r"^v: .*more than 14 decoded frames \(multimodal.max_video_decoded_frames"):
        load_video(make_video(24, keyframe_interval=24), limits, "v")
    roomy = MultimodalConfig(video_num_frames=4, max_video_decoded_frames=24)
    assert indices(load_video(make_video(24, keyframe_interval=24), roomy, "v")) == [0, 8, 15, 23]


def test_timeline_length_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(video, "_MAX_TIMELINE", 10)
    assert indices(load_video(make_video(10), LIMITS, "v")) == list(range(10))
    with pytest.raises(MediaError, match=r"^v: the video has more than 10 frames"):
        load_video(make_video(11), LIMITS, "v")


def test_video_given_as_data_url_base64_or_path(tmp_path) -> None:
    data = make_video(10)
    want = list(range(10))
    assert indices(load_video("data:video/mp4;base64," + base64.b64encode(data).decode(), LIMITS, "v")) == want
    assert indices(load_video(base64.b64encode(data).decode(), LIMITS, "v")) == want
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    local = MultimodalConfig(allow_local_paths=True)
    assert indices(load_video(str(path), local, "v")) == want
    assert indices(load_video(f"file://{path}", local, "v")) == want
    with pytest.raises(MediaError, match=r"^v: local video paths are not allowed \(multimodal.allow_local_paths\)"):
        load_video(str(path), LIMITS, "v")
    with pytest.raises(MediaError, match=r"^v: http\(s\) video URLs are not allowed \(multimodal.allow_urls\)"):
        load_video("https://example.com/clip.mp4", LIMITS, "v")


def _audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def _no_frames() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    return buf.getvalue()


@pytest.mark.parametrize(
    ("make", "limits", "reason"),
    [
        (lambda: make_video(24), MultimodalConfig(max_video_bytes=1000), "the video exceeds 1000 bytes"),
        (lambda: b"\x00\x00\x00\x18ftypmp42 but no video", LIMITS, "cannot decode the video"),
        (_audio_only, LIMITS, "the file holds no video stream"),
        (_no_frames, LIMITS, "the video has no frames"),
        (lambda: make_video(4), MultimodalConfig(max_image_pixels=64 * 48 - 1), "the video is 64x48; at most 3071"),
        # A playlist naming a local file: its demuxer is refused before it opens anything.
        (lambda: b"#EXTM3U\n#EXTINF:1,\nfile:///etc/hostname\n#EXT-X-ENDLIST\n", LIMITS, "cannot decode the video"),
        (lambda: b"ffconcat version 1.0\nfile 'clip.mp4'\n", LIMITS, "cannot decode the video"),
    ],
)
def test_bad_video_files_are_media_errors_naming_the_field(make, limits, reason: str) -> None:
    with pytest.raises(MediaError, match="^video_data\\[2\\]: " + reason.replace("(", "\\(")):
        load_video(make(), limits, "video_data[2]")


def test_truncated_video_gives_the_frames_it_holds() -> None:
    data = make_video(24, container="matroska")  # frames stored in order, no index at the end
    frames = load_video(data[: len(data) // 2], LIMITS, "v")
    assert 0 < len(frames) < 16 and indices(frames) == list(range(len(frames)))


def test_frame_lists_work_as_before() -> None:
    frames = [Image.new("RGB", (32, 24), frame_colour(i)) for i in range(3)]
    assert indices(load_video(frames, LIMITS, "v")) == [0, 1, 2]
    with pytest.raises(MediaError, match=r"^v: a video is a video file or a non-empty list of frames"):
        load_video([], LIMITS, "v")
    with pytest.raises(MediaError, match=r"^v: 3 frames; at most 2"):
        load_video(frames, MultimodalConfig(max_video_frames=2), "v")
    with pytest.raises(MediaError, match=r"^v: expected video bytes or a string, got int"):
        load_video(7, LIMITS, "v")


def test_a_request_pixel_budget_stops_a_video_at_the_frame_that_crosses_it() -> None:
    # 40 x 30 frames, 16 sampled: 19,200 pixels. A budget of 10,000 holds 8 frames; the 9th fails,
    # charged before it is converted (and a frame list is charged before each frame is decoded).
    data = make_video(24, width=40, height=30)
    limits = MultimodalConfig(max_request_pixels=10_000)
    with pytest.raises(MediaError, match=r"video_data\[0\]: the request's images and video frames exceed 10000"):
        load_video(data, limits, "video_data[0]", PixelBudget(limits))
    assert len(load_video(data, MultimodalConfig(), "video_data[0]", PixelBudget(MultimodalConfig()))) == 16
    budget = PixelBudget(limits)
    budget.charge(9_000, 1, "image_data[0]")  # an image earlier in the request
    frames = [Image.new("RGB", (30, 30))] * 2
    with pytest.raises(MediaError, match=r"video_data\[0\]\[1\]"):
        load_video(frames, limits, "video_data[0]", budget)
