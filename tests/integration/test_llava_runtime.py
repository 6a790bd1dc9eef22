"""`Runtime` (scheduler and detokenizer processes) with a tiny LLaVA-OneVision checkpoint: an image
given as bytes and a 4-frame video given as frame bytes, greedy tokens against transformers; the
repeated request is served from the cache."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from rxf.entrypoints.runtime import Runtime
from rxf.plugins.multimodal.tiny import make_llava_checkpoint

PROMPT = "<|im_start|>user\n<image>\n<video>\nWhat happens?<|im_end|>\n<|im_start|>assistant\n"


def png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def hf_greedy(path, rt: Runtime, image: bytes, frames: list[bytes], n: int) -> list[int]:
    from transformers import AutoModelForImageTextToText

    proc = rt.tokenizer_manager.preparer.mm_processor
    ids, items = proc.process(rt.tokenizer.encode(PROMPT), [image], [frames])
    for item in items:
        token = proc.image_token_id if item.modality == "image" else proc.video_token_id
        ids[item.offset : item.offset + item.length] = [token] * item.length
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in [image, *frames]]
    out = proc.hf(text="<image> a <video>", images=pil[:1], videos=[pil[1:]], return_tensors="pt")
    inputs = {"input_ids": torch.tensor([ids])} | {
        k: torch.as_tensor(out[k]) for k in ("pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
        if k in out
    }
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


def test_runtime_image_and_video_match_transformers(tmp_path) -> None:
    path = make_llava_checkpoint(tmp_path / "ov", "llava_onevision", seed=9)
    image, frames = png(50, 80, 1), [png(32, 48, 10 + i) for i in range(4)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with Runtime.from_config(None, **{"model.path": str(path), "runtime.device": "cpu",
                                      "attention.backend": "torch_native", "cache.max_total_tokens": 4096}) as rt:
        first = rt.generate(PROMPT, params, image_data=[image], video_data=[frames])
        second = rt.generate(PROMPT, params, image_data=[image], video_data=[frames])
        expected = hf_greedy(path, rt, image, frames, 6)
    assert first["output_ids"] == expected and second["output_ids"] == expected
    assert second["meta_info"]["cached_tokens"] >= second["meta_info"]["prompt_tokens"] - 10
