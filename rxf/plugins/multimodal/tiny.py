"""Random-weight LLaVA-family checkpoints with their Hugging Face processors (tests, benchmarks).

`make_llava_checkpoint(path, family)` writes config, weights, tokenizer (with `<image>` and `<video>`
tokens and a chat template that places them) and the processor, all through transformers'
`save_pretrained`, so transformers and rxf load the very same directory. Sizes default to tiny
(CPU tests); the benchmark passes production shapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rxf.testing.checkpoints import TINY_DEFAULTS, make_tiny_tokenizer, randomize_biases_and_norms

IMAGE, VIDEO = "<image>", "<video>"
# chatml whose list contents render image parts as "<image>\n" and video parts as "<video>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}{% elif part['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "image_size": 28, "patch_size": 7}
TINY_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84]]
FAMILIES = {
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
}


def _configs(family: str, tokenizer: Any, text: dict[str, Any], vision: dict[str, Any], pinpoints: list) -> Any:
    from transformers import AutoConfig

    ids = {"image_token_id": tokenizer.convert_tokens_to_ids(IMAGE)}
    text_type = "qwen2" if family == "llava_onevision" else "llama"
    vision_type = "siglip_vision_model" if family == "llava_onevision" else "clip_vision_model"
    text_cfg = AutoConfig.for_model(text_type, **text)
    vision_cfg = AutoConfig.for_model(vision_type, **vision)
    kwargs: dict[str, Any] = {"text_config": text_cfg.to_dict(), "vision_config": vision_cfg.to_dict(), **ids}
    if family == "llava_onevision":
        kwargs |= {"video_token_id": tokenizer.convert_tokens_to_ids(VIDEO), "vision_feature_layer": -1,
                   "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}
    else:
        kwargs |= {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
    if family != "llava":
        kwargs["image_grid_pinpoints"] = pinpoints
    return AutoConfig.for_model(family, architectures=[FAMILIES[family]], tie_word_embeddings=False, **kwargs)


def _has_torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def _processor(family: str, tokenizer: Any, config: Any, pinpoints: list) -> Any:
    import transformers as tf

    side, patch = config.vision_config.image_size, config.vision_config.patch_size
    if family == "llava":
        images = tf.CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        return tf.LlavaProcessor(images, tokenizer, patch_size=patch, vision_feature_select_strategy="default",
                                 num_additional_image_tokens=1, image_token=IMAGE)
    if family == "llava_next":
        images = tf.LlavaNextImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                            image_grid_pinpoints=pinpoints)
        return tf.LlavaNextProcessor(images, tokenizer, patch_size=patch, vision_feature_select_strategy="default",
                                     num_additional_image_tokens=1, image_token=IMAGE)
    size = {"height": side, "width": side}
    images = tf.LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=pinpoints)
    settings = {"num_image_tokens": (side // patch) ** 2, "vision_feature_select_strategy": "full",
                "image_token": IMAGE, "video_token": VIDEO}
    if not _has_torchvision():  # transformers' processor needs it for its video processor
        return _LiteSaver(images, settings)
    video = tf.LlavaOnevisionVideoProcessor(size=size)
    return tf.LlavaOnevisionProcessor(images, tokenizer, video, **settings)


class _LiteSaver:
    def __init__(self, images: Any, settings: dict[str, Any]) -> None:
        self.images, self.settings = images, settings

    def save_pretrained(self, path: Path) -> None:
        from rxf.plugins.multimodal.onevision_lite import write_lite_processor

        write_lite_processor(path, self.images, **self.settings)


def make_llava_checkpoint(
    path: str | Path,
    family: str = "llava",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    pinpoints: list[list[int]] | None = None,
    device: str = "cpu",
) -> Path:
    """Write a random `family` checkpoint ("llava", "llava_next", "llava_onevision") into `path`;
    the weights are drawn on `device` (large shapes initialise much faster on a GPU)."""
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(int(TINY_DEFAULTS["vocab_size"]))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE, VIDEO]})
    tokenizer.chat_template = CHAT_TEMPLATE
    text_kwargs = {**TINY_DEFAULTS, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                   "bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id, **(text or {})}
    pinpoints = pinpoints or TINY_PINPOINTS
    config = _configs(family, tokenizer, text_kwargs, {**TINY_VISION, **(vision or {})}, pinpoints)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    randomize_biases_and_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("image_newline"):
                param.normal_(0.0, 1.0)
    model.to(dtype).save_pretrained(path)
    _processor(family, tokenizer, config, pinpoints).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
