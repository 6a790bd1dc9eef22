"""Gemma 3 with images: transformers' SigLIP vision tower, Gemma 3's projector and rxf's Gemma 3
language model, composed as the LLaVA family is (`llava.py`: features cached by image hash, written
over the image's pad tokens during EXTEND, both checkpoint naming schemes loaded).

Per image (one tile; pan-and-scan crops are tiles of their own), the tower's last hidden state
`[patches, vision_hidden]` is average-pooled from a (image_size / patch_size)^2 grid down to
`mm_tokens_per_image` tokens, normalised (Gemma RMSNorm) and projected by a bias-free matrix. The
prompt layout (boi, the image tokens, eoi, with blank lines around) is the processor's
(`rxf.plugins.multimodal.gemma3`). The image tokens attend to each other bidirectionally, as in
transformers: the processor marks them `bidirectional` and the language model's attention layers
recompute their rows (`layers/bidirectional_blocks.py`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rxf.plugins.models.layers.norm import GemmaRMSNorm
from rxf.plugins.models.llava import LlavaForConditionalGeneration


class Gemma3Projector(nn.Module):
    """[tiles, patches, vision_hidden] -> [tiles, mm_tokens_per_image, text_hidden]."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = math.isqrt(config.mm_tokens_per_image)
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} is not a square that pools the "
                f"{self.patches_per_side}x{self.patches_per_side} patch grid evenly"
            )
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, text.hidden_size, dtype=dtype), requires_grad=False
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(tiles, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    projector_cls = Gemma3Projector

    def _select(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values=pixel_values.to(self.vision_tower.dtype))
        self.vision_encodes += 1
        return self.multi_modal_projector(out.last_hidden_state).to(self.features_dtype)
