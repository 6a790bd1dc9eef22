"""Turning what a client sent into RGB Pillow images, within the `multimodal` config's limits.

An image or a video file is given as raw bytes, a `data:` URL, a base64 string, an http(s) URL
(only with `allow_urls`), a local path or `file://` URL (only with `allow_local_paths`); an image
also as a Pillow image (Python callers). Videos are decoded in `rxf.plugins.multimodal.video`.
Every failure is a `MediaError` (a ValueError) whose message names the field, so the server
answers 400.
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
from rxf.core.echo import echo
from rxf.plugins.multimodal import url_fetch

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S)


class MediaError(ValueError):
    """The image or video is unreadable or not allowed; the message names the field."""


# The config field bounding each kind's encoded size, and the file names read as local paths.
_MAX_BYTES = {"image": "max_image_bytes", "video": "max_video_bytes"}
# Bare base64 of a JPEG (bytes FF D8 FF) starts with a slash, like an absolute path; no path starts so.
_JPEG_BASE64 = "/9j/"
_PATH_NAME = {
    "image": re.compile(r"^[\w.-]+\.(png|jpe?g|gif|bmp|webp|tiff?)$", re.I),
    "video": re.compile(r"^[\w.-]+\.(mp4|m4v|mov|webm|mkv|avi|ts|flv|mpe?g)$", re.I),
}


def _fetch_url(url: str, limits: MultimodalConfig, field: str, kind: str, max_bytes: int) -> bytes:
    try:
        return url_fetch.fetch(url, limits, max_bytes)
    except url_fetch.URLNotAllowed as exc:
        raise MediaError(f"{field}: this {kind} URL is not allowed: {exc}") from None
    except ValueError as exc:
        raise MediaError(f"{field}: {exc}") from None


def _read_path(path: str, limits: MultimodalConfig, field: str, kind: str, max_bytes: int) -> bytes:
    """The file's bytes. Missing, unreadable, not a file, or outside `local_path_roots`: one
    error, so a client cannot learn which files exist where it may not read."""
    if not limits.allow_local_paths:
        raise MediaError(f"{field}: local {kind} paths are not allowed (multimodal.allow_local_paths)")
    p = Path(path).resolve()  # symlinks and ".." resolved before the roots are compared
    roots = [Path(root).resolve() for root in limits.local_path_roots]
    try:
        if (roots and not any(p.is_relative_to(root) for root in roots)) or not p.is_file():
            raise OSError
        if p.stat().st_size > max_bytes:
            raise MediaError(f"{field}: the {kind} file exceeds {max_bytes} bytes")
        return p.read_bytes()
    except OSError:
        raise MediaError(
            f"{field}: no readable {kind} file at {echo(path)} (or not under multimodal.local_path_roots)"
        ) from None


def media_bytes(spec: Any, limits: MultimodalConfig, field: str, kind: str = "image") -> bytes:
    """The encoded image or video (`kind`) bytes that `spec` names or holds, within the kind's size limit."""
    max_bytes = getattr(limits, _MAX_BYTES[kind])
    if isinstance(spec, (bytes, bytearray, memoryview)):
        data = bytes(spec)
    elif not isinstance(spec, str):
        raise MediaError(f"{field}: expected {kind} bytes or a string, got {type(spec).__name__}")
    elif spec.startswith("data:"):
        match = _DATA_URL.match(spec)
        if match is None:
            raise MediaError(f"{field}: a data URL must be base64-encoded (data:{kind}/...;base64,...)")
        data = _b64decode(match["data"], field, kind, max_bytes)
    elif spec.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise MediaError(f"{field}: http(s) {kind} URLs are not allowed (multimodal.allow_urls)")
        data = _fetch_url(spec, limits, field, kind, max_bytes)
    elif spec.startswith("file://"):
        data = _read_path(spec.removeprefix("file://"), limits, field, kind, max_bytes)
    elif spec.startswith(_JPEG_BASE64):
        data = _b64decode(spec, field, kind, max_bytes)
    elif spec.startswith(("/", "./", "~")) or _PATH_NAME[kind].match(spec):
        data = _read_path(str(Path(spec).expanduser()), limits, field, kind, max_bytes)
    elif re.match(r"^[a-z][a-z0-9+.-]*://", spec, re.I):
        raise MediaError(f"{field}: URL scheme not allowed: {echo(spec.split(':', 1)[0])}")
    else:
        data = _b64decode(spec, field, kind, max_bytes)
    if len(data) > max_bytes:
        raise MediaError(f"{field}: the {kind} exceeds {max_bytes} bytes ({len(data)})")
    return data


def _b64decode(text: str, field: str, kind: str, max_bytes: int) -> bytes:
    if len(text) * 3 // 4 > max_bytes + 3:  # check before decoding a huge string
        raise MediaError(f"{field}: the {kind} exceeds {max_bytes} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{field}: not a valid base64 {kind} (nor an allowed URL or path)") from None


class PixelBudget:
    """The decoded pixels one request's images and video frames may hold together
    (`multimodal.max_request_pixels`; the per-image limit alone let 16 images of 40M pixels take
    5 GB). Each is charged from its header, before it is decoded, so a request past the budget
    fails at the item that crosses it, having decoded no more than the budget."""

    def __init__(self, limits: MultimodalConfig) -> None:
        self.limit = limits.max_request_pixels
        self.used = 0

    def charge(self, width: int, height: int, field: str) -> None:
        self.used += width * height
        if self.used > self.limit:
            raise MediaError(f"{field}: the request's images and video frames exceed {self.limit} decoded pixels "
                             "together (multimodal.max_request_pixels)")


def load_image(spec: Any, limits: MultimodalConfig, field: str, budget: PixelBudget | None = None) -> Image.Image:
    """An RGB image, decoded in full (a corrupt file fails here, not in the scheduler), charged to
    the request's `budget` before it is decoded."""
    if isinstance(spec, Image.Image):
        img = spec
        if budget is not None:
            budget.charge(img.width, img.height, field)
    else:
        data = media_bytes(spec, limits, field)
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > limits.max_image_pixels:
                raise MediaError(
                    f"{field}: the image is {img.width}x{img.height}; at most {limits.max_image_pixels} pixels"
                )
            if budget is not None:
                budget.charge(img.width, img.height, field)
            img.load()
        except MediaError:
            raise
        except Exception as exc:  # Pillow raises many types for bad data (OSError, SyntaxError, ...)
            raise MediaError(f"{field}: cannot decode the image: {exc}") from None
    if img.width * img.height > limits.max_image_pixels:
        raise MediaError(f"{field}: the image is {img.width}x{img.height}; at most {limits.max_image_pixels} pixels")
    return img.convert("RGB")
