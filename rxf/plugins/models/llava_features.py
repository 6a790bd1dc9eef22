"""Vision features of the LLaVA family, per image or video, in the order the prompt's pad tokens take them.

- LLaVA-1.5: one tile; the selected layer's patch features, projected.
- LLaVA-NeXT / OneVision images (anyres): tile 0 is the whole image resized (the base features),
  tiles 1.. cover the best-fitting grid resolution. The grid features are stitched back into one
  feature map, the padding the processor added to fit the grid is cropped away ("unpadding"),
  OneVision shrinks maps above `anyres_max_N` tiles, and a learned `image_newline` closes every row.
  A single-tile image (OneVision with several images in a prompt) is its base features + one newline.
- OneVision videos: each frame's feature map is pooled 2x (bilinear), frames are concatenated, and
  one newline ends the video.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch.nn import functional as F

from rxf.core.ipc.messages import MultimodalItem


def grid_shape(image_size: tuple[int, int], pinpoints: list[list[int]], tile: int) -> tuple[int, int]:
    """(rows, cols) of tiles for the best resolution the processor chose for an (h, w) image:
    the pinpoint keeping the most of the image's pixels after an aspect-preserving downscale,
    ties broken by the least wasted area."""
    h, w = image_size
    best, best_fit, best_waste = None, -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        fit = min(int(w * scale) * int(h * scale), w * h)
        waste = ph * pw - fit
        if fit > best_fit or (fit == best_fit and waste < best_waste):
            best, best_fit, best_waste = (ph, pw), fit, waste
    assert best is not None, "image_grid_pinpoints is empty"
    return best[0] // tile, best[1] // tile


def unpad(feature: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """Crop a [C, H, W] feature map to the original aspect ratio (the processor padded the
    resized image symmetrically to fill the grid)."""
    h, w = image_size
    cur_h, cur_w = feature.shape[1:]
    if w / h > cur_w / cur_h:  # wider than the grid: padded top and bottom
        new_h = int(round(h * (cur_w / w), 7))
        pad = (cur_h - new_h) // 2
        return feature[:, pad : cur_h - pad, :]
    new_w = int(round(w * (cur_h / h), 7))
    pad = (cur_w - new_w) // 2
    return feature[:, :, pad : cur_w - pad]


def with_newlines(feature: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    """[C, H, W] -> [H * (W + 1), C]: rows in order, each followed by the newline embedding."""
    c, h, _ = feature.shape
    rows = torch.cat([feature, newline.view(c, 1, 1).expand(c, h, 1).to(feature.dtype)], dim=2)
    return rows.flatten(1).transpose(0, 1)


def pack_anyres(
    tiles: torch.Tensor,
    image_size: tuple[int, int],
    newline: torch.Tensor | None,
    pinpoints: list[list[int]],
    tile_px: int,
    max_tiles: int | None,
) -> torch.Tensor:
    """tiles: [num_tiles, side * side, C] projected features -> [num_tokens, C]."""
    base = tiles[0]
    if tiles.shape[0] == 1:
        return base if newline is None else torch.cat([base, newline[None].to(base.dtype)])
    side = math.isqrt(base.shape[0])
    rows, cols = grid_shape(image_size, pinpoints, tile_px)
    grid = tiles[1:].view(rows, cols, side, side, -1)
    # [rows, cols, y, x, C] -> [C, rows * y, cols * x]: one feature map of the whole grid.
    grid = grid.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
    grid = unpad(grid, image_size)
    if max_tiles is not None:
        c, gh, gw = grid.shape
        ratio = math.sqrt(gh * gw / (max_tiles * side * side))
        if ratio > 1.1:
            grid = F.interpolate(grid[None], [int(gh // ratio), int(gw // ratio)], mode="bilinear")[0]
    body = with_newlines(grid, newline) if newline is not None else grid.flatten(1).transpose(0, 1)
    return torch.cat([base, body])


def pool_video(frames: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    """frames: [F, side * side, C] -> [F * ceil(side/2)^2 + 1, C] (2x bilinear pooling per frame)."""
    n, tokens, c = frames.shape
    side = math.isqrt(tokens)
    maps = frames.view(n, side, side, c).permute(0, 3, 1, 2)
    pooled = F.interpolate(maps, size=[math.ceil(side / 2)] * 2, mode="bilinear")
    return torch.cat([pooled.permute(0, 2, 3, 1).reshape(-1, c), newline[None].to(frames.dtype)])


def anyres_limit(config: Any) -> int | None:
    """OneVision's `vision_aspect_ratio = "anyres_max_N"` -> N (None: no limit, LLaVA-NeXT)."""
    ratio = getattr(config, "vision_aspect_ratio", None)
    return int(ratio.removeprefix("anyres_max_")) if isinstance(ratio, str) and ratio.startswith("anyres_max_") else None


class FeatureCache:
    """Projected features by item hash, least recently used dropped first beyond `max_bytes`. Lets an
    image whose KV was evicted from the radix cache skip the vision tower when it comes back."""

    def __init__(self, max_bytes: int = 512 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def get(self, key: int) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: int, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes or key in self._items:
            return
        self._items[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._items)


def needed_items(batch_items: list[list[MultimodalItem] | None], prefix_lens: list[int], extend_lens: list[int]):
    """Yield (token_row, item, lo, hi): the item's tokens [lo, hi) (item-relative) fall in this
    forward's new tokens, starting at flattened row `token_row`."""
    row = 0
    for items, prefix, n in zip(batch_items, prefix_lens, extend_lens, strict=True):
        for item in items or ():
            lo, hi = max(item.offset, prefix), min(item.offset + item.length, prefix + n)
            if lo < hi:
                yield row + lo - prefix, item, lo - item.offset, hi - item.offset
        row += n
