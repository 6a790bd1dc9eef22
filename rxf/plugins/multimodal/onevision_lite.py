"""LLaVA-OneVision preprocessing where transformers' processor cannot be built.

transformers' `LlavaOnevisionProcessor` requires its video processor, which requires torchvision (not
an rxf dependency). Without it, this stand-in runs the checkpoint's own OneVision *image* processor
(Pillow backend) and transformers' own token-count rule (`LlavaOnevisionProcessor`'s methods, bound
to this object), and preprocesses video frames with the image processor as one multi-image batch
(resize to the tile size, rescale, normalize: what the video processor does, with Pillow resampling
instead of torchvision's). Its output has the keys and layout of the real processor's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch


def needs_lite(model_path: str) -> bool:
    import importlib.util

    from transformers import AutoConfig

    is_onevision = AutoConfig.from_pretrained(model_path).model_type == "llava_onevision"
    return is_onevision and importlib.util.find_spec("torchvision") is None


def write_lite_processor(path: str | Path, image_processor: Any, **settings: Any) -> None:
    """Save what the stand-in loads: the image processor plus the processor's own settings."""
    image_processor.save_pretrained(path)
    (Path(path) / "processor_config.json").write_text(
        json.dumps({"processor_class": "LlavaOnevisionProcessor", **settings}, indent=2)
    )


class OnevisionLiteProcessor:
    def __init__(self, model_path: str) -> None:
        from transformers import AutoConfig, AutoImageProcessor, LlavaOnevisionProcessor

        config = AutoConfig.from_pretrained(model_path)
        self.image_token_id, self.video_token_id = int(config.image_token_id), int(config.video_token_id)
        settings = json.loads((Path(model_path) / "processor_config.json").read_text())
        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.num_image_tokens = int(settings["num_image_tokens"])
        self.vision_feature_select_strategy = settings.get("vision_feature_select_strategy", "full")
        self.vision_aspect_ratio = settings.get("vision_aspect_ratio", "anyres_max_9")
        self.image_token = settings.get("image_token", "<image>")
        self.video_token = settings.get("video_token", "<video>")
        # transformers' own token-count rule for anyres images, bound to this object.
        cls = LlavaOnevisionProcessor
        self._get_number_of_features = cls._get_number_of_features.__get__(self)
        self._get_unpadded_features = cls._get_unpadded_features.__get__(self)

    def image_tokens(self, size: tuple[int, int], tile: tuple[int, int], multi: bool) -> int:
        n = self.num_image_tokens + 1 if multi else self._get_number_of_features(*size, *tile)
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    def video_tokens(self, frames: int) -> int:
        pooled = math.ceil(math.isqrt(self.num_image_tokens) / 2)
        return frames * pooled * pooled + 1

    def __call__(self, text: str, images: list | None = None, videos: list | None = None, **_: Any) -> dict:
        """`text` is only placeholders: returns runs of their ids (separated by -1) and the tensors."""
        out: dict[str, Any] = {}
        counts: list[int] = []
        if images:
            processed = self.image_processor([images], return_tensors="pt")  # one sample: several images
            out.update(processed)
            tile = tuple(processed["pixel_values"].shape[-2:])
            multi = len(images) > 1
            counts = [self.image_tokens(tuple(int(s) for s in size), tile, multi) for size in processed["image_sizes"]]
        video_counts = []
        if videos:
            clips = [self.image_processor([frames], return_tensors="pt")["pixel_values"][:, 0] for frames in videos]
            # Stacked as the real processor's output where the clips agree; videos shorter than
            # `video_num_frames` keep all their frames, so two of them may differ in length: a list.
            out["pixel_values_videos"] = torch.stack(clips) if len({c.shape for c in clips}) == 1 else clips
            video_counts = [c.shape[0] for c in clips]
        ids: list[int] = []
        images_left, videos_left = iter(counts), iter(video_counts)
        for token in text.split(" a "):
            if token == self.image_token:
                ids += [self.image_token_id] * next(images_left)
            else:
                ids += [self.video_token_id] * self.video_tokens(next(videos_left))
            ids.append(-1)
        out["input_ids"] = torch.tensor([ids])
        return out
