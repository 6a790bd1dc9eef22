"""Random-weight multimodal checkpoints with their Hugging Face processors (tests, benchmarks).

`make_llava_checkpoint(path, family)` writes config, weights, tokenizer (with `<image>` and `<video>`
tokens and a chat template that places them) and the processor, all through transformers'
`save_pretrained`, so transformers and rxf load the very same directory; `make_gemma3_checkpoint`
does the same for Gemma 3 (`<start_of_image>` in the prompt). Sizes default to tiny (CPU tests);
the benchmark passes production shapes.
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


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("'<image>\\n'", "'<start_of_image>'")
# 56 px / 7 px patches: an 8x8 patch grid, pooled 2x2 into mm_tokens_per_image = 16 tokens.
GEMMA3_VISION = {**TINY_VISION, "image_size": 56, "vision_use_head": False}
# initializer_range 0.08: Gemma scales embeddings by sqrt(hidden), and at the tiny default (0.25) the
# newest token's embedding drowns its context (greedy tokens repeat one id).
GEMMA3_TEXT = {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16, "tie_word_embeddings": True,
               "layer_types": ["sliding_attention", "full_attention"], "initializer_range": 0.08}


def make_gemma3_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    mm_tokens_per_image: int = 16,
) -> Path:
    """Write a random Gemma3ForConditionalGeneration checkpoint (SigLIP tower, Gemma 3 text model)
    with its Gemma3Processor into `path`."""
    import transformers as tf
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = make_tiny_tokenizer(int(TINY_DEFAULTS["vocab_size"]))
    base.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token=base.bos_token, eos_token=base.eos_token,
        pad_token=base.pad_token, chat_template=GEMMA3_CHAT_TEMPLATE, extra_special_tokens=GEMMA3_TOKENS,
    )
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in GEMMA3_TOKENS.items()}
    text_cfg = AutoConfig.for_model("gemma3_text", **{
        **TINY_DEFAULTS, **GEMMA3_TEXT, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id, **(text or {})})
    vision_cfg = AutoConfig.for_model("siglip_vision_model", **{**GEMMA3_VISION, **(vision or {})})
    config = AutoConfig.for_model(
        "gemma3", architectures=["Gemma3ForConditionalGeneration"], text_config=text_cfg.to_dict(),
        vision_config=vision_cfg.to_dict(), mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        tie_word_embeddings=text_cfg.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    randomize_biases_and_norms(model)
    with torch.no_grad():  # transformers initialises the projection to zeros: images would not matter
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
    model.to(dtype).save_pretrained(path)
    side = vision_cfg.image_size
    images = tf.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    tf.Gemma3Processor(images, tokenizer, image_seq_length=mm_tokens_per_image).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
