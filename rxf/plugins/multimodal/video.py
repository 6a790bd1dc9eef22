"""Videos as RGB frames: a list of frames (images), or a video file (mp4/mov, webm/mkv, avi,
mpeg-ps/ts, flv; no other container is opened) decoded with PyAV.

A video file is sampled to `multimodal.video_num_frames` frames (at most `max_video_frames`)
spread evenly over its whole length, first and last frame included; a shorter video gives all its
frames. Decoding is bounded: a demux-only pass (no decoding) lists the frames' timestamps and
keyframes, then each wanted frame is reached by seeking to the last keyframe before it when that
skips frames, so the decoder sees about `video_num_frames` x keyframe interval frames, never more
than `max_video_decoded_frames`. The same file always yields the same frames (hence the same
content hash and cache hits). Every failure is a `MediaError` naming the field.
"""

from __future__ import annotations

import io
from array import array
from typing import Any

import numpy as np
from PIL import Image

from rxf.core.config import MultimodalConfig
from rxf.plugins.multimodal.media import MediaError, PixelBudget, load_image, media_bytes

# Demuxers FFmpeg may pick for the data. Others are refused before they run: some (hls, concat)
# would open further files or URLs that a playlist names.
_FORMATS = "mov,matroska,avi,mpegts,mpeg,flv"
_CONTAINERS = "mp4/mov, webm/mkv, avi, mpeg-ps/ts or flv"
# Frames listed in one video's timeline (9 h at 30 fps): bounds the demux pass's memory and time.
_MAX_TIMELINE = 1_000_000


def load_video(spec: Any, limits: MultimodalConfig, field: str, budget: PixelBudget | None = None) -> list[Image.Image]:
    """A video given as a non-empty list of frames (each as `load_image` takes it), or as one video
    file (bytes, base64, a data: URL, or a URL / path where allowed); each frame charged to the
    request's `budget` before it is decoded."""
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise MediaError(f"{field}: a video is a video file or a non-empty list of frames (images)")
        if len(spec) > limits.max_video_frames:
            raise MediaError(f"{field}: {len(spec)} frames; at most {limits.max_video_frames}")
        return [load_image(frame, limits, f"{field}[{i}]", budget) for i, frame in enumerate(spec)]
    return decode_video(media_bytes(spec, limits, field, "video"), limits, field, budget)


def sample_indices(total: int, n: int) -> list[int]:
    """`n` frame indices spread evenly over [0, total), first and last included; all if total <= n."""
    if total <= n:
        return list(range(total))
    # The step (total - 1) / (n - 1) exceeds 1, so the rounded indices are distinct and increasing.
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def decode_video(data: bytes, limits: MultimodalConfig, field: str, budget: PixelBudget | None = None) -> list[Image.Image]:
    """The sampled frames of the encoded video `data`, as RGB images."""
    import av  # on first use: plugins load in every process, and only this one decodes

    # FFmpeg's errors surface as several types (av.FFmpegError, OSError, ValueError, ...).
    try:
        container = av.open(io.BytesIO(data), options={"format_whitelist": _FORMATS})
    except Exception as exc:
        raise MediaError(f"{field}: cannot decode the video as {_CONTAINERS} ({exc})") from None
    try:
        with container:
            return _sample(container, limits, field, budget)
    except MediaError:
        raise
    except Exception as exc:
        raise MediaError(f"{field}: cannot decode the video: {exc}") from None


def _sample(container, limits: MultimodalConfig, field: str, budget: PixelBudget | None) -> list[Image.Image]:
    if not container.streams.video:
        raise MediaError(f"{field}: the file holds no video stream")
    stream = container.streams.video[0]
    _check_pixels(stream.codec_context.width, stream.codec_context.height, limits, field)
    pts, keys = _timeline(container, stream, field)
    if len(pts) == 0:
        raise MediaError(f"{field}: the video has no frames")
    wanted = sample_indices(len(pts), min(limits.video_num_frames, limits.max_video_frames))
    frames: list[Image.Image] = []
    decoded, position, frames_iter = 0, -1, None  # position: index of the last frame taken
    for index in wanted:
        k = int(np.searchsorted(keys, index, side="right")) - 1  # the last keyframe at or before index
        key = int(keys[k]) if k >= 0 else -1
        if frames_iter is None or key > position + 1:  # a seek skips frames position+1 .. key-1
            # (The first seek also rewinds after the demux pass; without a keyframe, to the start.)
            container.seek(int(pts[max(key, 0)]), stream=stream, backward=True)
            frames_iter = container.decode(stream)
        for frame in frames_iter:
            decoded += 1
            if decoded > limits.max_video_decoded_frames:
                raise MediaError(
                    f"{field}: sampling the video needs more than {limits.max_video_decoded_frames} decoded "
                    "frames (multimodal.max_video_decoded_frames); keyframes are too sparse"
                )
            if frame.pts is not None and frame.pts >= pts[index]:
                _check_pixels(frame.width, frame.height, limits, field)
                if budget is not None:
                    budget.charge(frame.width, frame.height, field)
                frames.append(frame.to_image())
                break
        else:
            raise MediaError(f"{field}: the video ends before its frame {index} (of {len(pts)} listed)")
        position = index
    return frames


def _timeline(container, stream, field: str) -> tuple[np.ndarray, np.ndarray]:
    """The frames' timestamps in presentation order, and the indices (into them) of keyframes."""
    stamps, key_stamps = array("q"), array("q")  # compact: a timeline may list a million frames
    for packet in container.demux(stream):
        if packet.size == 0 or packet.is_discard:  # the end-of-stream marker; frames edit lists drop
            continue
        if packet.pts is None:
            raise MediaError(f"{field}: the video's frames carry no timestamps")
        stamps.append(packet.pts)
        if packet.is_keyframe:
            key_stamps.append(packet.pts)
        if len(stamps) > _MAX_TIMELINE:
            raise MediaError(f"{field}: the video has more than {_MAX_TIMELINE} frames")
    pts = np.sort(np.frombuffer(stamps, dtype=np.int64))
    return pts, np.unique(np.searchsorted(pts, np.frombuffer(key_stamps, dtype=np.int64)))


def _check_pixels(width: int, height: int, limits: MultimodalConfig, field: str) -> None:
    if width * height > limits.max_image_pixels:
        raise MediaError(f"{field}: the video is {width}x{height}; at most {limits.max_image_pixels} pixels a frame")
