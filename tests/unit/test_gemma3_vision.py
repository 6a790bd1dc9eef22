"""Gemma 3 with images on a tiny random checkpoint (SigLIP 8x8 patches pooled to 16 image tokens,
local window 12 < 16), against transformers' Gemma3ForConditionalGeneration.

transformers lets one image's tokens attend to each other both ways (its mask from
`token_type_ids`); rxf recomputes those rows over the KV pool (`layers/bidirectional_blocks.py`).
Checked: the expanded prompt and pixels equal the HF processor's; logits at every position equal
the reference's (and differ from causal attention, so the check can fail); an extend whose cached
prefix ends inside an image; greedy tokens through the scheduler with prefill chunks smaller than
an image, which never end inside one; a repeated image hits the radix cache without the tower.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import MultimodalItem, PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.req import Req
from rxf.core.scheduler.scheduler import Scheduler
from rxf.plugins.multimodal.gemma3 import Gemma3Processor, _Splicer, newline_tokens
from rxf.plugins.multimodal.tiny import make_gemma3_checkpoint

PROMPT = "<|im_start|>user\n<start_of_image>What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\nCompare <start_of_image> with<start_of_image>, please.<|im_end|>\n<|im_start|>assistant\n"


def image(h: int, w: int, seed: int) -> Image.Image:
    """A 4x4 grid of random colours: pixel noise would give every image nearly the same features."""
    grid = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(grid).resize((w, h), Image.NEAREST)


class Setup:
    def __init__(self, path) -> None:
        from transformers import AutoProcessor  # not at import: it imports triton (see test_llava.py)

        self.config = load_config(
            {"model": {"path": str(path)}, "runtime": {"device": "cpu"}, "attention": {"backend": "torch_native"},
             "cache": {"max_total_tokens": 4096}}
        )
        self.runner = ModelRunner(self.config, PluginRegistry.load(), str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = Gemma3Processor(str(path), self.config.multimodal, self.runner.vocab_size)
        self.hf_processor = AutoProcessor.from_pretrained(path)
        self.hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.model = self.runner.model
        self.path = path

    def ours(self, text: str, images: list[Image.Image]) -> tuple[list[int], list[MultimodalItem]]:
        return self.processor.process(self.tokenizer.encode(text), images, None)

    def hf_inputs(self, text: str, images: list[Image.Image]):
        return self.hf_processor(text=text, images=images, return_tensors="pt")

    @torch.inference_mode()
    def hf_logits(self, inputs, bidirectional: bool = True) -> torch.Tensor:
        if not bidirectional:
            inputs = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        return self.hf(**inputs).logits[0].float()

    def hf_greedy(self, text: str, images, n: int = 6) -> list[int]:
        """Full forwards (no cache): the prompt's image tokens bidirectional, new tokens causal."""
        inputs = dict(self.hf_inputs(text, images))
        out = []
        for _ in range(n):
            out.append(int(self.hf_logits(inputs)[-1].argmax()))
            for key in ("input_ids", "token_type_ids", "attention_mask"):
                extra = out[-1] if key == "input_ids" else int(key == "attention_mask")
                inputs[key] = torch.cat([inputs[key], torch.tensor([[extra]])], dim=1)
        return out

    def scheduler(self, **overrides) -> Scheduler:
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool.clear()
        config = self.config.model_copy(update={"scheduler": self.config.scheduler.model_copy(update=overrides)})
        return Scheduler(config, self.runner, self.tokenizer, check_memory=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"), seed=3, text={"sliding_window": 12}))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def as_hf_ids(setup: Setup, ids: list[int], items: list[MultimodalItem]) -> list[int]:
    image_token = setup.runner.hf_config.image_token_id
    in_item = {i for it in items for i in range(it.offset, it.offset + it.length)}
    return [image_token if i in in_item else t for i, t in enumerate(ids)]


def prefill(setup: Setup, ids: list[int], items: list[MultimodalItem]) -> tuple[torch.Tensor, int, torch.Tensor]:
    runner = setup.runner
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    row, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(ids))
    logits = runner.forward(
        ModelInput(ForwardMode.PREFILL, [row], ids, [0], [len(ids)], slots, logits_start=[0], mm_items=[items])
    )
    return logits, row, slots


@pytest.mark.parametrize(("text", "sizes"), [(PROMPT, [(40, 70)]), (PROMPT, [(90, 30)]), (TWO, [(30, 30), (50, 80)])])
def test_prompt_and_pixels_match_hf_processor(setup: Setup, text, sizes) -> None:
    imgs = [image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    ids, items = setup.ours(text, imgs)
    ref = setup.hf_inputs(text, imgs)
    assert as_hf_ids(setup, ids, items) == ref["input_ids"][0].tolist()
    assert [it.length for it in items] == [16] * len(imgs) and all(it.bidirectional for it in items)
    torch.testing.assert_close(torch.cat([it.data["pixel_values"] for it in items]), ref["pixel_values"])


@pytest.mark.parametrize(("text", "n_images"), [(PROMPT, 1), (TWO, 2)])
def test_logits_match_hf_bidirectional_images(setup: Setup, text, n_images) -> None:
    imgs = [image(40 + 10 * i, 60, seed=10 + i) for i in range(n_images)]
    ids, items = setup.ours(text, imgs)
    ours, _, _ = prefill(setup, ids, items)
    inputs = setup.hf_inputs(text, imgs)
    ref = setup.hf_logits(inputs)
    assert_logits_close(ours, ref)
    causal = setup.hf_logits(inputs, bidirectional=False)  # what a causal-only model would give
    assert (causal - ref).abs().max() > 100 * 1e-4 * ref.abs().max()


class _PanAndScan:
    """The checkpoint's HF processor, called with pan-and-scan on (transformers' default is off)."""

    KWARGS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 20, "pan_and_scan_max_num_crops": 3}

    def __init__(self, hf) -> None:
        self.hf, self.boi_token = hf, hf.boi_token

    def __call__(self, **kwargs):
        return self.hf(**kwargs, **self.KWARGS)


def test_pan_and_scan_crops_are_items_of_their_own(setup: Setup) -> None:
    """A wide image becomes the whole image plus 3 crops, each its own bidirectional block."""
    img = image(40, 140, seed=5)
    with mock.patch.object(setup.processor, "hf", _PanAndScan(setup.processor.hf)):
        ids, items = setup.ours(PROMPT, [img])
    ref = setup.hf_processor(text=PROMPT, images=[img], return_tensors="pt", **_PanAndScan.KWARGS)
    assert len(items) == 4 and as_hf_ids(setup, ids, items) == ref["input_ids"][0].tolist()
    torch.testing.assert_close(torch.cat([it.data["pixel_values"] for it in items]), ref["pixel_values"])
    assert_logits_close(prefill(setup, ids, items)[0], setup.hf_logits(ref))


def test_newline_runs_merge_where_the_expansion_meets_the_prompt() -> None:
    """Gemma's tokenizer has one token per newline run; the boi's expansion starts and ends with
    "\n\n", so "user\n" + "\n\n<boi>" must become "user", "\n\n\n", as the whole text tokenizes."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["\n", "\n\n", "\n\n\n", "\n\n\n\n", "a", "b"])}
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, merges)))
    tok.add_special_tokens({"additional_special_tokens": ["<boi>", "<eoi>"]})
    assert newline_tokens(tok) == {0: 1, 1: 2, 2: 3, 3: 4}
    enc = tok.encode
    splice = _Splicer(SimpleNamespace(newlines=newline_tokens(tok), tokenizer=tok, vocab_size=len(tok)))
    for piece in ("a\n", "\n\n<boi>"):
        splice.text(enc(piece))
    splice.item(torch.zeros(1, 3, 2, 2), 2)
    for piece in ("<eoi>\n\n", "\n\n<boi>"):  # a second image right after the first
        splice.text(enc(piece))
    splice.item(torch.ones(1, 3, 2, 2), 2)
    for piece in ("<eoi>\n\n", "\nb"):
        splice.text(enc(piece))
    pads = {i for it in splice.items for i in range(it.offset, it.offset + it.length)}
    text = [t for i, t in enumerate(splice.ids) if i not in pads]
    assert text == enc("a\n\n\n<boi><eoi>\n\n\n\n<boi><eoi>\n\n\nb")  # the whole text, images left out
    assert [it.offset for it in splice.items] == [3, 8]


def test_extend_over_a_cached_prefix_ending_inside_the_image(setup: Setup) -> None:
    """A radix hit may end inside an image: its cached part was computed with the whole image, and
    the rest of the image must still see all of it."""
    img = image(40, 70, seed=20)
    ids, items = setup.ours(PROMPT, [img])
    (item,) = items
    _, row, slots = prefill(setup, ids, items)
    runner = setup.runner
    shared = item.offset + 5
    new_row = runner.req_to_token_pool.alloc()
    logits = runner.forward(
        ModelInput(ForwardMode.EXTEND, [new_row], ids[shared:], [shared], [len(ids) - shared],
                   runner.token_to_kv_pool.alloc(len(ids) - shared), row_writes=[(0, slots[:shared])],
                   logits_start=[0], mm_items=[items])
    )
    assert_logits_close(logits, setup.hf_logits(setup.hf_inputs(PROMPT, [img]))[shared:])


def run(sched: Scheduler, rid: str, ids: list[int], items, max_new: int = 6) -> dict:
    params = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    sched.add_request(PreparedRequest(rid, ids, params, mm_items=items))
    out = {"ids": []}
    while sched.has_work:
        for o in sched.step():
            out["ids"] += o.new_token_ids
            out["cached"] = o.cached_tokens
    return out


def test_greedy_with_prefill_chunks_smaller_than_an_image(setup: Setup) -> None:
    imgs = [image(40, 70, seed=30), image(60, 30, seed=31)]
    ids, items = setup.ours(TWO, imgs)
    sched = setup.scheduler(chunked_prefill_size=7)
    forward = mock.Mock(wraps=setup.runner.forward_with_aux)  # what the step executor calls
    with mock.patch.object(setup.runner, "forward_with_aux", forward):
        out = run(sched, "r", ids, items)
    assert out["ids"] == setup.hf_greedy(TWO, imgs)
    ends = [inp.prefix_lens[0] + inp.extend_lens[0] for (inp,), _ in forward.call_args_list if not inp.mode.is_decode()]
    assert len(ends) > 3 and ends[-1] == len(ids)
    for it in items:  # every chunk ended outside the images
        assert not any(it.offset < end < it.offset + it.length for end in ends), (ends, it.offset)


def test_chunk_len_keeps_bidirectional_items_whole() -> None:
    items = [MultimodalItem("image", 1, 10, 16, bidirectional=True), MultimodalItem("image", 2, 40, 16)]
    req = Req(PreparedRequest("r", list(range(60)), SamplingParams.from_dict({}), mm_items=items))
    assert req.chunk_len(0, 8) == 8  # ends before the image
    assert req.chunk_len(4, 8) == 6  # would end inside it: stops at its start
    assert req.chunk_len(10, 8) == 16  # starts at it: runs to its end
    assert req.chunk_len(13, 4) == 13  # starts inside it (a cached prefix ended there): to its end
    assert req.chunk_len(26, 8) == 8 and req.chunk_len(36, 8) == 8  # at its end; the causal item splits


def test_repeated_image_hits_cache_and_skips_vision_tower(setup: Setup) -> None:
    sched = setup.scheduler()
    model = setup.model
    model.feature_cache = type(model.feature_cache)()
    img = image(40, 70, seed=40)
    ids, items = setup.ours(PROMPT, [img])
    tower = mock.Mock(wraps=model.vision_tower.forward)
    with mock.patch.object(model.vision_tower, "forward", tower):
        a = run(sched, "a", ids, items)
        assert a["cached"] == 0 and tower.call_count == 1
        assert a["ids"] == setup.hf_greedy(PROMPT, [img])
        text_b = PROMPT.replace("What is in the picture?", "Describe it.")
        b = run(sched, "b", *setup.ours(text_b, [img]))
        assert b["cached"] >= items[0].offset + items[0].length and tower.call_count == 1
        assert b["ids"] == setup.hf_greedy(text_b, [img])
        # Another image of the same size: other pad ids, so nothing from its first token on hits.
        other = image(40, 70, seed=43)
        ids_d, items_d = setup.ours(PROMPT, [other])
        d = run(sched, "d", ids_d, items_d)
        assert d["cached"] <= items_d[0].offset and tower.call_count == 2
        assert d["ids"] == setup.hf_greedy(PROMPT, [other]) != a["ids"]


# The tiny checkpoint's names (transformers 5 writes `language_model.model.*`, `vision_tower.*`,
# `multi_modal_projector.*`) rewritten as the released checkpoints have them (the tower under
# `vision_tower.vision_model.`) and as transformers 5 names them in memory (`model.*`).
LAYOUTS = {
    "hub": {"vision_tower.": "vision_tower.vision_model."},
    "transformers5": {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                      "multi_modal_projector.": "model.multi_modal_projector."},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_name_layouts_load(setup: Setup, tmp_path, layout: str) -> None:
    from safetensors.torch import load_file, save_file

    renames = LAYOUTS[layout]
    shutil.copytree(setup.path, tmp_path / layout, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for name, t in load_file(setup.path / "model.safetensors").items():
        prefix = next((p for p in renames if name.startswith(p)), "")
        tensors[renames.get(prefix, "") + name.removeprefix(prefix)] = t
    save_file(tensors, tmp_path / layout / "model.safetensors", metadata={"format": "pt"})
    ids, items = setup.ours(PROMPT, [image(40, 70, seed=50)])
    ours = prefill(setup, ids, items)[0]
    runner = setup.runner
    setup.runner = ModelRunner(setup.config, PluginRegistry.load(), str(tmp_path / layout))
    try:
        assert torch.equal(prefill(setup, ids, items)[0], ours)
    finally:
        setup.runner = runner


def test_bad_inputs_are_refused(setup: Setup) -> None:
    ids = setup.tokenizer.encode(PROMPT)
    with pytest.raises(ValueError, match="image_data: 2 images for 1 image placeholders"):
        setup.processor.process(ids, [image(28, 28, 0), image(28, 28, 1)], None)
    with pytest.raises(ValueError, match="video_data: Gemma 3 takes images only"):
        setup.processor.process(ids, [image(28, 28, 0)], [[image(28, 28, 1)]])
    with pytest.raises(ValueError, match=r"image_data\[0\]: cannot decode"):
        setup.processor.process(ids, [b"\x89PNG not really"], None)


def test_bf16_model_without_onednn_bf16_runs_its_tower_in_float32(setup: Setup, monkeypatch) -> None:
    """As LLaVA's (test_llava.py): where oneDNN has no bf16 kernels (forced here), a bf16 model's
    SigLIP tower and projector are float32, and its features are the float32 model's rounded once."""
    from rxf.plugins.quantization import cpu_packing

    monkeypatch.setattr(cpu_packing, "onednn_bf16", lambda: False)
    config = load_config(setup.config, **{"model.dtype": "bfloat16"})
    bf16 = ModelRunner(config, PluginRegistry.load(), config.model.path).model
    assert {p.dtype for p in bf16.vision_tower.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.multi_modal_projector.parameters()} == {torch.float32}
    _, items = setup.ours(PROMPT, [image(40, 70, seed=20)])
    with torch.inference_mode():
        ours = bf16.encode(items)[0]
        ref = setup.runner.model.encode(items)[0]
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref.bfloat16())
