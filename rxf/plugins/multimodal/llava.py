"""The LLaVA family's multimodal processor (runs in the TokenizerManager's process).

Preprocessing is the checkpoint's own Hugging Face processor (image processor, video processor and
its rule for how many tokens an image becomes), so pixels and token counts match transformers
exactly. Each image placeholder token in the prompt is then expanded into that many pad ids drawn
from the item's content hash: the same image always yields the same ids (the radix cache reuses its
KV), two different images practically never share one (each id is a draw from the vocabulary).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from rxf.core.config import MultimodalConfig
from rxf.core.ipc.messages import MultimodalItem
from rxf.plugins.models.llava_features import grid_shape
from rxf.plugins.multimodal.media import MediaError, PixelBudget, load_image
from rxf.plugins.multimodal.onevision_lite import OnevisionLiteProcessor, needs_lite
from rxf.plugins.multimodal.video import load_video


def content_hash(modality: str, tensors: list[torch.Tensor], extra: tuple[int, ...]) -> int:
    """64-bit digest of what the vision tower will see (so equal hashes mean equal features)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(modality.encode())
    h.update(np.asarray(extra, dtype=np.int64).tobytes())
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def pad_ids(item_hash: int, length: int, vocab_size: int) -> list[int]:
    """`length` ids in [0, vocab_size) determined by the hash (their embeddings are overwritten)."""
    return np.random.default_rng(item_hash).integers(0, vocab_size, length).tolist()


def _runs(ids: list[int], token_ids: set[int]) -> list[tuple[int, int]]:
    """(token id, run length) of each maximal run of a placeholder token, in order."""
    runs: list[tuple[int, int]] = []
    prev = None
    for t in ids:
        if t in token_ids:
            if t == prev:
                runs[-1] = (t, runs[-1][1] + 1)
            else:
                runs.append((t, 1))
        prev = t
    return runs


class LlavaProcessor:
    """`process(input_ids, images, videos)` -> (input_ids with pad runs, their MultimodalItems)."""

    def __init__(self, model_path: str, limits: MultimodalConfig, vocab_size: int) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.hf = OnevisionLiteProcessor(model_path) if needs_lite(model_path) else AutoProcessor.from_pretrained(model_path)
        self.config = AutoConfig.from_pretrained(model_path)
        self.limits = limits
        self.vocab_size = vocab_size
        self.image_token_id = int(self.config.image_token_id)
        self.video_token_id = getattr(self.config, "video_token_id", None)
        self.tokens = {self.image_token_id: self.hf.image_token}
        if self.video_token_id is not None:
            self.tokens[int(self.video_token_id)] = self.hf.video_token

    def process(
        self, input_ids: list[int], images: list[Any] | None, videos: list[Any] | None
    ) -> tuple[list[int], list[MultimodalItem]]:
        images, videos = list(images or []), list(videos or [])
        media_fields = " and ".join(f for f, items in (("image_data", images), ("video_data", videos)) if items)
        if len(images) + len(videos) > self.limits.max_items_per_request:
            raise MediaError(f"{media_fields}: at most {self.limits.max_items_per_request} images and videos per request")
        placeholders = [t for t in input_ids if t in self.tokens]
        n_img = placeholders.count(self.image_token_id)
        n_vid = len(placeholders) - n_img
        if n_img != len(images):
            raise MediaError(f"image_data: {len(images)} images for {n_img} image placeholders in the prompt")
        if n_vid != len(videos):
            raise MediaError(f"video_data: {len(videos)} videos for {n_vid} video placeholders in the prompt")
        if not placeholders:
            return input_ids, []
        budget = PixelBudget(self.limits)
        pil_images = [load_image(s, self.limits, f"image_data[{i}]", budget) for i, s in enumerate(images)]
        frames = [load_video(s, self.limits, f"video_data[{i}]", budget) for i, s in enumerate(videos)]
        # The placeholders alone, separated by a word so that each expands into a run of its own.
        text = " a ".join(self.tokens[t] for t in placeholders)
        try:
            out = self.hf(text=text, images=pil_images or None, videos=frames or None, return_tensors="pt")
        except Exception as exc:  # the HF processor rejects e.g. degenerate sizes with various types
            raise MediaError(f"{media_fields}: preprocessing failed: {exc}") from None
        runs = _runs(out["input_ids"][0].tolist(), set(self.tokens))
        assert [t for t, _ in runs] == placeholders, "the processor reordered the placeholders"
        per_item = self._item_data(out, len(pil_images), len(frames))
        items, new_ids, k = [], [], {self.image_token_id: 0, self.video_token_id: 0}
        for t in input_ids:
            if t not in self.tokens:
                new_ids.append(t)
                continue
            modality = "image" if t == self.image_token_id else "video"
            data = per_item[modality][k[t]]
            length = runs[len(items)][1]
            k[t] += 1
            extra = tuple(int(s) for s in data.get("image_size", ()))
            h = content_hash(modality, [data["pixel_values"]], extra)
            items.append(MultimodalItem(modality, h, len(new_ids), length, data))
            new_ids += pad_ids(h, length, self.vocab_size)
        return new_ids, items

    def _item_data(self, out: Any, n_images: int, n_videos: int) -> dict[str, list[dict[str, Any]]]:
        """Split the processor's batched tensors per item, dropping the tile padding of anyres batches."""
        images = []
        pv, sizes = out.get("pixel_values"), out.get("image_sizes")
        multi = "batch_num_images" in out and int(out["batch_num_images"][0]) > 1  # OneVision: no anyres
        for i in range(n_images):
            if pv.dim() == 4:  # one tile per image (LLaVA-1.5)
                images.append({"pixel_values": pv[i : i + 1].clone()})
                continue
            size = tuple(int(s) for s in sizes[i])
            if multi:
                n_tiles = 1
            else:
                rows, cols = grid_shape(size, self.config.image_grid_pinpoints, self.config.vision_config.image_size)
                n_tiles = rows * cols + 1
            images.append({"pixel_values": pv[i, :n_tiles].clone(), "image_size": size})
        videos = [{"pixel_values": out["pixel_values_videos"][i].clone()} for i in range(n_videos)]
        return {"image": images, "video": videos}
