"""Gemma 3's multimodal processor (runs in the TokenizerManager's process).

The prompt marks each image with Gemma's `<start_of_image>` (boi) token, as its chat template
writes it. The checkpoint's own Hugging Face processor preprocesses the image and gives the text
the boi becomes: a blank line, boi, `mm_tokens_per_image` image tokens (256 in the released
checkpoints), eoi, a blank line; with pan-and-scan, the whole image and then each crop that way.
Each run of image tokens is one item (one tile of pixels), its tokens replaced by pad ids drawn
from the tile's content hash (see `llava.py`) and marked `bidirectional`: Gemma 3's image tokens
attend to each other both ways.

The expansion is spliced into the already tokenized prompt; where it meets a newline token of the
prompt (the template's "user\n" before an image), the two newline runs are merged into the token
the tokenizer itself gives the longer run ("\n" + "\n\n" -> "\n\n\n"), so the ids equal what the
Hugging Face processor makes of the whole text.
"""

from __future__ import annotations

from typing import Any

from rxf.core.config import MultimodalConfig
from rxf.core.ipc.messages import MultimodalItem
from rxf.plugins.multimodal.llava import content_hash, pad_ids
from rxf.plugins.multimodal.media import MediaError, PixelBudget, load_image

_MAX_NEWLINES = 32  # newline runs up to this long are looked up as single tokens


def newline_tokens(tokenizer: Any) -> dict[int, int]:
    """The tokenizer's single tokens for runs of newlines: id -> number of newlines."""
    out = {}
    for n in range(1, _MAX_NEWLINES + 1):
        ids = tokenizer.encode("\n" * n, add_special_tokens=False)
        if len(ids) == 1:
            out[ids[0]] = n
    return out


class Gemma3Processor:
    """`process(input_ids, images, videos)` -> (input_ids with pad runs, their MultimodalItems)."""

    def __init__(self, model_path: str, limits: MultimodalConfig, vocab_size: int) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.hf = AutoProcessor.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.limits = limits
        self.vocab_size = vocab_size
        self.boi_id = int(config.boi_token_id)
        self.image_id = int(config.image_token_id)
        self.tokenizer = self.hf.tokenizer
        self.newlines = newline_tokens(self.tokenizer)

    def process(
        self, input_ids: list[int], images: list[Any] | None, videos: list[Any] | None
    ) -> tuple[list[int], list[MultimodalItem]]:
        images = list(images or [])
        if videos:
            raise MediaError("video_data: Gemma 3 takes images only")
        if len(images) > self.limits.max_items_per_request:
            raise MediaError(f"image_data: at most {self.limits.max_items_per_request} images per request")
        n_img = input_ids.count(self.boi_id)
        if n_img != len(images):
            raise MediaError(f"image_data: {len(images)} images for {n_img} image placeholders in the prompt")
        if not images:
            return input_ids, []
        budget = PixelBudget(self.limits)
        pil_images = [load_image(s, self.limits, f"image_data[{i}]", budget) for i, s in enumerate(images)]
        out = _Splicer(self)
        next_image = iter(pil_images)
        piece: list[int] = []
        for t in input_ids:
            if t != self.boi_id:
                piece.append(t)
                continue
            out.text(piece)
            piece = []
            self._expand(out, next(next_image))
        out.text(piece)
        return out.ids, out.items

    def _expand(self, out: _Splicer, image: Any) -> None:
        """Append what one image's boi becomes: the processor's text, one item per tile."""
        try:
            hf = self.hf(text=self.hf.boi_token, images=[image], return_tensors="pt", add_special_tokens=False)
        except Exception as exc:  # the HF processor rejects e.g. degenerate sizes with various types
            raise MediaError(f"image_data: preprocessing failed: {exc}") from None
        tiles = iter(hf["pixel_values"])
        ids = hf["input_ids"][0].tolist()
        start = 0
        while start < len(ids):
            is_image = ids[start] == self.image_id
            end = start
            while end < len(ids) and (ids[end] == self.image_id) == is_image:
                end += 1
            if is_image:
                out.item(next(tiles)[None].clone(), end - start)
            else:
                out.text(ids[start:end])
            start = end


class _Splicer:
    """The new prompt, built piece by piece: text pieces (merged with the previous text piece where
    two newline runs meet) and image items (pad ids)."""

    def __init__(self, processor: Gemma3Processor) -> None:
        self.p = processor
        self.ids: list[int] = []
        self.items: list[MultimodalItem] = []
        self._ends_with_text = False  # the last id is text (not an item's pad), so it may merge

    def text(self, tokens: list[int]) -> None:
        if not tokens:
            return
        nl = self.p.newlines
        if self._ends_with_text and self.ids[-1] in nl and tokens[0] in nl:
            run = "\n" * (nl[self.ids[-1]] + nl[tokens[0]])
            self.ids[-1:] = self.p.tokenizer.encode(run, add_special_tokens=False)
            tokens = tokens[1:]
        self.ids += tokens
        self._ends_with_text = True

    def item(self, pixel_values: Any, length: int) -> None:
        h = content_hash("image", [pixel_values], ())
        self.items.append(
            MultimodalItem("image", h, len(self.ids), length, {"pixel_values": pixel_values}, bidirectional=True)
        )
        self.ids += pad_ids(h, length, self.p.vocab_size)
        self._ends_with_text = False
