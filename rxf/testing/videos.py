"""Small video files built at test time with PyAV: frame i is one flat colour that identifies it."""

from __future__ import annotations

import io

import av
import numpy as np
from PIL import Image

# Colours on a 3x3x3 grid of the RGB cube: any two differ by >= 112 in a channel, far above what
# lossy coding changes in a flat frame.
MAX_FRAMES = 27


def frame_colour(i: int) -> tuple[int, int, int]:
    assert 0 <= i < MAX_FRAMES, "frame colours are distinct for 27 frames"
    r, g, b = (16 + 112 * (i // 3**c % 3) for c in range(3))
    return r, g, b


def make_video(
    n_frames: int = 24,
    width: int = 64,
    height: int = 48,
    codec: str = "mpeg4",
    container: str = "mp4",
    keyframe_interval: int = 6,
    fps: int = 24,
) -> bytes:
    """An encoded video whose frame i is `frame_colour(i)`, with a keyframe every `keyframe_interval`
    frames (scene-cut keyframes off, where the encoder has the option)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps, options={"sc_threshold": "1000000000"})
        stream.width, stream.height, stream.gop_size = width, height, keyframe_interval
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for i in range(n_frames):
            pixels = np.empty((height, width, 3), np.uint8)
            pixels[:] = frame_colour(i)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def frame_index(image: Image.Image) -> int:
    """Which frame's colour `image` shows (the nearest one at its centre)."""
    centre = np.asarray(image.convert("RGB"))[image.height // 2, image.width // 2].astype(int)
    return int(np.argmin([np.abs(centre - frame_colour(i)).sum() for i in range(MAX_FRAMES)]))
