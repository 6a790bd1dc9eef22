"""Video-file sampling cost on the CPU: `rxf.plugins.multimodal.video.decode_video` (16 frames by
keyframe seeks, converted to RGB) against the plain way to the same frames (decode every frame in
order with PyAV, convert the 16 sampled ones to RGB), on H.264 clips built here (a moving gradient,
so frames differ).

    OMP_NUM_THREADS=1 python benchmarks/bench_video_decode.py [--frames 900] [--size 640x360] \
        [--keyint 30 250] [--rounds 3]

Reports the median wall time over rounds of each side, per keyframe interval.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import av
import numpy as np

from rxf.core.config import MultimodalConfig
from rxf.plugins.multimodal.video import decode_video, sample_indices


def clip(frames: int, width: int, height: int, keyint: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=30, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", keyint
        y, x = np.mgrid[0:height, 0:width]
        for i in range(frames):
            pixels = np.stack([(x + 3 * i) % 256, (y + 2 * i) % 256, np.full_like(x, i % 256)], -1)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    n = fn()
    return time.perf_counter() - start, n


def sequential(data: bytes, n_frames: int, sample: int) -> int:
    wanted = set(sample_indices(n_frames, sample))
    with av.open(io.BytesIO(data)) as container:
        return len([f.to_image() for i, f in enumerate(container.decode(video=0)) if i in wanted])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=900)
    parser.add_argument("--size", default="640x360")
    parser.add_argument("--keyint", type=int, nargs="+", default=[30, 250])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    limits = MultimodalConfig()
    for keyint in args.keyint:
        data = clip(args.frames, width, height, keyint)
        ours, full = [], []
        for _ in range(args.rounds):
            t, n_ours = timed(lambda: len(decode_video(data, limits, "video")))  # noqa: B023 (called now)
            ours.append(t)
            t, n_full = timed(lambda: sequential(data, args.frames, limits.video_num_frames))  # noqa: B023
            full.append(t)
        print(f"{args.frames} frames {args.size} H.264 keyint {keyint} ({len(data)} bytes): "
              f"decode_video {n_ours} frames {statistics.median(ours) * 1e3:.0f} ms; "
              f"sequential decode, {n_full} frames {statistics.median(full) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
