"""Turning what a client sent into RGB Pillow images, within the `multimodal` config's limits.

An image is given as raw bytes, a `data:` URL, a base64 string, an http(s) URL (only with
`allow_urls`), a local path or `file://` URL (only with `allow_local_paths`), or a Pillow image
(Python callers). A video is a list of such frames. Every failure is a `MediaError` (a ValueError)
whose message names the field, so the server answers 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path
from typing import Any

from PIL import Image

from rxf.core.config import MultimodalConfig

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S)


class MediaError(ValueError):
    """The image or video is unreadable or not allowed; the message names the field."""


def _fetch_url(url: str, limits: MultimodalConfig, field: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=limits.url_timeout_s, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise MediaError(f"{field}: fetching {url} answered HTTP {resp.status_code}")
            data = bytearray()
            for chunk in resp.iter_bytes():
                data += chunk
                if len(data) > limits.max_image_bytes:
                    raise MediaError(f"{field}: the image at {url} exceeds {limits.max_image_bytes} bytes")
            return bytes(data)
    except httpx.HTTPError as exc:
        raise MediaError(f"{field}: cannot fetch {url}: {type(exc).__name__}") from None


def _read_path(path: str, limits: MultimodalConfig, field: str) -> bytes:
    if not limits.allow_local_paths:
        raise MediaError(f"{field}: local image paths are not allowed (multimodal.allow_local_paths)")
    p = Path(path)
    if not p.is_file():
        raise MediaError(f"{field}: no image file at {path}")
    if p.stat().st_size > limits.max_image_bytes:
        raise MediaError(f"{field}: the image file exceeds {limits.max_image_bytes} bytes")
    return p.read_bytes()


def image_bytes(spec: Any, limits: MultimodalConfig, field: str) -> bytes:
    """The encoded image bytes that `spec` names or holds."""
    if isinstance(spec, (bytes, bytearray, memoryview)):
        data = bytes(spec)
    elif not isinstance(spec, str):
        raise MediaError(f"{field}: expected image bytes or a string, got {type(spec).__name__}")
    elif spec.startswith("data:"):
        match = _DATA_URL.match(spec)
        if match is None:
            raise MediaError(f"{field}: a data URL must be base64-encoded (data:image/...;base64,...)")
        data = _b64decode(match["data"], limits, field)
    elif spec.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise MediaError(f"{field}: http(s) image URLs are not allowed (multimodal.allow_urls)")
        data = _fetch_url(spec, limits, field)
    elif spec.startswith("file://"):
        data = _read_path(spec.removeprefix("file://"), limits, field)
    elif spec.startswith(("/", "./", "~")) or re.match(r"^[\w.-]+\.(png|jpe?g|gif|bmp|webp|tiff?)$", spec, re.I):
        data = _read_path(str(Path(spec).expanduser()), limits, field)
    elif re.match(r"^[a-z][a-z0-9+.-]*://", spec, re.I):
        raise MediaError(f"{field}: URL scheme not allowed: {spec.split(':', 1)[0]}")
    else:
        data = _b64decode(spec, limits, field)
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"{field}: the image exceeds {limits.max_image_bytes} bytes ({len(data)})")
    return data


def _b64decode(text: str, limits: MultimodalConfig, field: str) -> bytes:
    if len(text) * 3 // 4 > limits.max_image_bytes + 3:  # check before decoding a huge string
        raise MediaError(f"{field}: the image exceeds {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{field}: not a valid base64 image (nor an allowed URL or path)") from None


def load_image(spec: Any, limits: MultimodalConfig, field: str) -> Image.Image:
    """An RGB image, decoded in full (a corrupt file fails here, not in the scheduler)."""
    if isinstance(spec, Image.Image):
        img = spec
    else:
        data = image_bytes(spec, limits, field)
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > limits.max_image_pixels:
                raise MediaError(
                    f"{field}: the image is {img.width}x{img.height}; at most {limits.max_image_pixels} pixels"
                )
            img.load()
        except MediaError:
            raise
        except Exception as exc:  # Pillow raises many types for bad data (OSError, SyntaxError, ...)
            raise MediaError(f"{field}: cannot decode the image: {exc}") from None
    if img.width * img.height > limits.max_image_pixels:
        raise MediaError(f"{field}: the image is {img.width}x{img.height}; at most {limits.max_image_pixels} pixels")
    return img.convert("RGB")


def load_video(spec: Any, limits: MultimodalConfig, field: str) -> list[Image.Image]:
    """A video given as a list of frames (each as an image)."""
    if not isinstance(spec, (list, tuple)) or not spec:
        raise MediaError(f"{field}: a video is a non-empty list of frames (images)")
    if len(spec) > limits.max_video_frames:
        raise MediaError(f"{field}: {len(spec)} frames; at most {limits.max_video_frames}")
    return [load_image(frame, limits, f"{field}[{i}]") for i, frame in enumerate(spec)]
