"""The LLaVA family as one composable model: a vision tower + a projector + any registered rxf
language model, assembled from the checkpoint's config (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision).

The vision tower is transformers' own module (CLIP, SigLIP, ...): it runs once per image, needs no
KV cache, and its outputs are cached by image hash (on a CPU whose oneDNN has no bf16 kernels a
bf16 model builds its tower and projector in float32, `cpu_packing.large_matmul_dtype`: every matmul
there has hundreds of patch rows, where emulated bf16 is 5-6x slower). The language model is our
paged-KV model.
During EXTEND the model embeds the new tokens, computes features only for the image/video items
whose pad tokens fall in the new (uncached) tokens, and writes them over those rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoModel
from transformers.activations import ACT2FN

from rxf.core.forward import ForwardBatch
from rxf.core.ipc.messages import MultimodalItem
from rxf.plugins.models.llava_features import (
    FeatureCache,
    anyres_limit,
    needed_items,
    pack_anyres,
    pool_video,
)
from rxf.plugins.quantization import cpu_packing

logger = logging.getLogger(__name__)

# Text configs written without `architectures` (common in LLaVA checkpoints) name their model type.
_LM_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


# Released checkpoints name the tower's tensors `vision_tower.vision_model.*`; transformers 5's
# CLIP / SigLIP vision models hold them without the `vision_model.` level (it renames on load).
_HUB_TOWER = "vision_tower.vision_model."


def _language_model_class(text_config: Any) -> type[nn.Module]:
    from rxf.core.registry import PluginRegistry

    archs = list(getattr(text_config, "architectures", None) or [])
    if text_config.model_type in _LM_BY_MODEL_TYPE:
        archs.append(_LM_BY_MODEL_TYPE[text_config.model_type])
    return PluginRegistry.load().model_class(archs)


class Projector(nn.Module):
    """Vision hidden size (x the number of selected layers) -> text hidden size: linear, act, linear."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        layers = config.vision_feature_layer
        n_layers = 1 if isinstance(layers, int) else len(layers)
        bias = getattr(config, "multimodal_projector_bias", True)
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size * n_layers, text_hidden, bias=bias, dtype=dtype)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    projector_cls: type[nn.Module] = Projector  # vision features -> text embeddings: `cls(config, dtype)`

    @classmethod
    def max_context_length(cls, config: Any) -> int:
        """The language model's (see llama.py), or its max_position_embeddings."""
        supported = getattr(_language_model_class(config.text_config), "max_context_length", None)
        return supported(config.text_config) if supported else int(config.text_config.max_position_embeddings)

    def __init__(self, config: Any, dtype: torch.dtype | None = None, context_length: int | None = None) -> None:
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        self.config = config
        self.features_dtype = dtype  # the language model's: projected features are cached in it
        tower_dtype = cpu_packing.large_matmul_dtype(dtype)
        self.vision_tower = AutoModel.from_config(config.vision_config, dtype=tower_dtype)
        self.multi_modal_projector = self.projector_cls(config, tower_dtype)
        lm_cls = _language_model_class(config.text_config)
        served = {"context_length": context_length} if hasattr(lm_cls, "max_context_length") else {}
        self.language_model = lm_cls(config.text_config, dtype=dtype, **served)
        self.feature_cache = FeatureCache()
        self.vision_encodes = 0  # vision tower calls so far (observability; tests assert on it)

    # ---- features ----
    def _select(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, C, H, W] -> projected patch features [tiles, patches, text_hidden]."""
        out = self.vision_tower(pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype),
                                output_hidden_states=True)
        self.vision_encodes += 1
        layers = self.config.vision_feature_layer
        picked = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
        if self.config.vision_feature_select_strategy == "default":
            picked = [h[:, 1:] for h in picked]  # drop CLS
        return self.multi_modal_projector(torch.cat(picked, dim=-1)).to(self.features_dtype)

    def tiles(self, item: MultimodalItem) -> torch.Tensor:
        """The item's pixel tiles (images: anyres tiles or one; videos: frames), [n, C, H, W]."""
        return item.data["pixel_values"]

    def pack(self, item: MultimodalItem, projected: torch.Tensor) -> torch.Tensor:
        """Projected per-tile features of one item -> its token features, [item.length, hidden]."""
        return projected.flatten(0, 1)

    def encode(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Features of each item: from the cache, else from one vision-tower call for all misses."""
        out: dict[int, torch.Tensor] = {}
        missing: dict[int, MultimodalItem] = {}
        for item in items:
            cached = self.feature_cache.get(item.hash)
            if cached is not None:
                out[item.hash] = cached
            else:
                missing.setdefault(item.hash, item)
        if missing:
            device = self.vision_tower.device
            tiles = [self.tiles(item) for item in missing.values()]
            projected = self._select(torch.cat(tiles).to(device, non_blocking=True))
            for item, part in zip(missing.values(), projected.split([t.shape[0] for t in tiles]), strict=True):
                feats = self.pack(item, part)
                if feats.shape[0] != item.length:
                    raise ValueError(f"{item.modality} gives {feats.shape[0]} features for {item.length} tokens")
                self.feature_cache.put(item.hash, feats)
                out[item.hash] = feats
        return [out[item.hash] for item in items]

    # ---- forward ----
    def forward(self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.language_model.model.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        if batch.mm_items is not None and batch.mode.is_extend():
            spans = list(needed_items(batch.mm_items, batch.prefix_lens_cpu, batch.extend_lens_cpu))
            if spans:
                feats = self.encode([item for _, item, _, _ in spans])
                for (row, _, lo, hi), f in zip(spans, feats, strict=True):
                    embeds[row : row + hi - lo] = f[lo:hi].to(embeds.dtype)
        return self.language_model(batch, embeds)

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names, old (`language_model.model.*`, `vision_tower.vision_model.*`) or new
        (`model.language_model.*`, `model.vision_tower.*`): vision parts load here, the rest goes to
        the language model's own loader under its causal-LM names."""
        own = {n: p for n, p in self.named_parameters() if not n.startswith("language_model.")}
        filled: set[str] = set()

        def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.language_model."):
                    yield "model." + name.removeprefix("model.language_model."), tensor
                    continue
                if name.startswith(("language_model.", "lm_head.")):
                    yield name.removeprefix("language_model."), tensor
                    continue
                name = name.removeprefix("model.")
                if name not in own and name.startswith(_HUB_TOWER):
                    name = "vision_tower." + name.removeprefix(_HUB_TOWER)
                if name in own:
                    if own[name].shape != tensor.shape:
                        raise ValueError(f"cannot load {name}: shape {tuple(tensor.shape)} != {tuple(own[name].shape)}")
                    with torch.no_grad():
                        own[name].copy_(tensor)
                    filled.add(name)
                else:
                    raise ValueError(f"{type(self).__name__}: checkpoint tensor {name} has no matching parameter")

        self.language_model.load_weights(language_weights())
        unfilled = sorted(set(own) - filled)
        if unfilled:
            raise ValueError(f"{type(self).__name__}: parameters the checkpoint did not fill: {unfilled[:20]}")


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """Anyres images: tiles of the best grid resolution, unpadded, with a newline per row."""

    def __init__(self, config: Any, dtype: torch.dtype | None = None, context_length: int | None = None) -> None:
        super().__init__(config, dtype, context_length)
        dtype = dtype or torch.get_default_dtype()
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size, dtype=dtype))
        self.max_tiles = anyres_limit(config)

    def pack(self, item: MultimodalItem, projected: torch.Tensor) -> torch.Tensor:
        vision = self.config.vision_config
        size = tuple(int(s) for s in item.data["image_size"])
        return pack_anyres(
            projected, size, self.image_newline, self.config.image_grid_pinpoints, vision.image_size, self.max_tiles
        )


class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    """SigLIP + Qwen2; anyres capped at `anyres_max_N` tiles; several images; videos as frames."""

    def pack(self, item: MultimodalItem, projected: torch.Tensor) -> torch.Tensor:
        if item.modality == "video":
            return pool_video(projected, self.image_newline)
        return super().pack(item, projected)
