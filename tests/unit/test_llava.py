"""LLaVA-1.5 and LLaVA-NeXT (anyres) on tiny random checkpoints, against transformers.

Each checkpoint is written with transformers' own configs and processors; rxf preprocesses with the
same processor and expands each `<image>` into pad ids from the image's content hash. Checked:
the expanded prompt and pixels equal the HF processor's; logits at every prompt position and greedy
tokens equal `AutoModelForImageTextToText`'s; a repeated image hits the radix cache without running
the vision tower; a different image of the same size does not hit.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.plugins.multimodal.llava import LlavaProcessor
from rxf.plugins.multimodal.tiny import make_llava_checkpoint

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
# (height, width): wide, tall, square, very wide -> different anyres grids and unpadding.
SIZES = [(40, 70), (70, 40), (28, 28), (30, 100)]


def image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


class Setup:
    def __init__(self, path, **overrides) -> None:
        # Imported here: importing AutoProcessor imports triton, which must not happen before
        # test_triton_attention sets TRITON_INTERPRET (at collection).
        from transformers import AutoProcessor

        self.config = load_config(
            {"model": {"path": str(path)}, "runtime": {"device": "cpu"}, "attention": {"backend": "torch_native"},
             "cache": {"max_total_tokens": 4096}},
            **overrides,
        )
        self.runner = ModelRunner(self.config, PluginRegistry.load(), str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = LlavaProcessor(str(path), self.config.multimodal, self.runner.vocab_size)
        self.hf_processor = AutoProcessor.from_pretrained(path)
        self.hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.model = self.runner.model

    def scheduler(self, **scheduler_overrides) -> Scheduler:
        """A fresh scheduler (and tree) over the shared runner, whose pools are emptied first."""
        self.runner.req_to_token_pool.clear()
        self.runner.token_to_kv_pool.clear()
        config = self.config.model_copy(
            update={"scheduler": self.config.scheduler.model_copy(update=scheduler_overrides)}
        )
        return Scheduler(config, self.runner, self.tokenizer, check_memory=True)

    def ours(self, text: str, images: list[Image.Image]):
        return self.processor.process(self.tokenizer.encode(text), images, None)

    def hf_inputs(self, text: str, images: list[Image.Image]):
        return self.hf_processor(text=text, images=images, return_tensors="pt")


@pytest.fixture(scope="module", params=["llava", "llava_next"])
def setup(request, tmp_path_factory) -> Setup:
    return Setup(make_llava_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3))


def run(sched: Scheduler, rid: str, ids: list[int], items, max_new: int = 6) -> dict:
    params = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    sched.add_request(PreparedRequest(rid, ids, params, mm_items=items))
    out = {"ids": []}
    while sched.has_work:
        for o in sched.step():
            out["ids"] += o.new_token_ids
            out["cached"] = o.cached_tokens
    return out


def hf_greedy(s: Setup, text: str, images, n: int = 6) -> list[int]:
    inputs = s.hf_inputs(text, images)
    with torch.inference_mode():
        seq = s.hf.generate(**inputs, max_new_tokens=n, do_sample=False)
    return seq[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("size", SIZES)
def test_prompt_and_pixels_match_hf_processor(setup: Setup, size) -> None:
    img = image(*size, seed=1)
    ids, items = setup.ours(PROMPT, [img])
    ref = setup.hf_inputs(PROMPT, [img])
    (item,) = items
    image_token = setup.runner.hf_config.image_token_id
    as_hf = [image_token if item.offset <= i < item.offset + item.length else t for i, t in enumerate(ids)]
    assert as_hf == ref["input_ids"][0].tolist()
    assert image_token not in ids[item.offset : item.offset + item.length]  # replaced by hash pads
    ours = item.data["pixel_values"]
    pixels = ref["pixel_values"] if ref["pixel_values"].dim() == 4 else ref["pixel_values"][0]  # [tiles, C, H, W]
    torch.testing.assert_close(ours, pixels[: ours.shape[0]])
    assert not pixels[ours.shape[0] :].any()  # anyres: tiles past ours are only the batch's padding


@pytest.mark.parametrize("size", SIZES)
def test_logits_match_hf_at_every_position(setup: Setup, size) -> None:
    img = image(*size, seed=2)
    ids, items = setup.ours(PROMPT, [img])
    runner = setup.runner
    runner.req_to_token_pool.clear()
    runner.token_to_kv_pool.clear()
    row, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(ids))
    ours = runner.forward(
        ModelInput(ForwardMode.PREFILL, [row], ids, [0], [len(ids)], slots, logits_start=[0], mm_items=[items])
    )
    with torch.inference_mode():
        ref = setup.hf(**setup.hf_inputs(PROMPT, [img])).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_greedy_matches_hf_with_image_split_over_prefill_chunks(setup: Setup) -> None:
    imgs = [image(*SIZES[0], seed=4), image(*SIZES[3], seed=5)]
    for i, img in enumerate(imgs):
        ids, items = setup.ours(PROMPT, [img])
        sched = setup.scheduler(chunked_prefill_size=7)
        assert run(sched, f"r{i}", ids, items)["ids"] == hf_greedy(setup, PROMPT, [img])


def test_repeated_image_hits_cache_and_skips_vision_tower(setup: Setup) -> None:
    sched = setup.scheduler()
    model = setup.model
    model.feature_cache = type(model.feature_cache)()  # start empty
    first = image(*SIZES[0], seed=10)
    same_size_other = image(*SIZES[0], seed=11)
    ids, items = setup.ours(PROMPT, [first])
    image_end = items[0].offset + items[0].length
    tower = mock.Mock(wraps=model.vision_tower.forward)
    with mock.patch.object(model.vision_tower, "forward", tower):
        a = run(sched, "a", ids, items)
        assert a["cached"] == 0 and tower.call_count == 1
        assert a["ids"] == hf_greedy(setup, PROMPT, [first])

        # The same image, another question: the image's pad ids hit the radix cache.
        text_b = PROMPT.replace("What is in the picture?", "Describe it.")
        ids_b, items_b = setup.ours(text_b, [first])
        b = run(sched, "b", ids_b, items_b)
        assert b["cached"] >= image_end
        assert tower.call_count == 1  # not called again
        assert b["ids"] == hf_greedy(setup, text_b, [first])

        # Its KV evicted (cache flushed): the features come from the feature cache.
        assert sched.flush_cache()[0]
        c = run(sched, "c", ids, items)
        assert c["cached"] == 0 and tower.call_count == 1 and c["ids"] == a["ids"]

        # A different image of the same size: its pads differ, so nothing past the text before it hits.
        ids_d, items_d = setup.ours(PROMPT, [same_size_other])
        assert items_d[0].hash != items[0].hash and items_d[0].length == items[0].length
        d = run(sched, "d", ids_d, items_d)
        assert d["cached"] < image_end and tower.call_count == 2
        assert d["ids"] == hf_greedy(setup, PROMPT, [same_size_other])


def test_placeholder_count_must_match_images(setup: Setup) -> None:
    with pytest.raises(ValueError, match="image_data: 2 images for 1 image placeholders"):
        setup.ours(PROMPT, [image(28, 28, 0), image(28, 28, 1)])
    with pytest.raises(ValueError, match=r"image_data\[0\]: cannot decode"):
        setup.processor.process(setup.tokenizer.encode(PROMPT), [b"\x89PNG not really"], None)


def test_pad_ids_are_in_vocab_deterministic_and_distinct_per_hash() -> None:
    from rxf.plugins.multimodal.llava import pad_ids

    a, b = pad_ids(2**64 - 1, 576, 32064), pad_ids(12345, 576, 32064)
    assert a == pad_ids(2**64 - 1, 576, 32064) and all(0 <= t < 32064 for t in a + b)
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 5  # independent draws: ~576/32064 agree


def test_feature_cache_is_bounded_lru() -> None:
    from rxf.plugins.models.llava_features import FeatureCache

    cache = FeatureCache(max_bytes=3 * 400)  # three [10, 10] float32 tensors
    for key in range(3):
        cache.put(key, torch.full((10, 10), float(key)))
    assert cache.get(0) is not None  # 0 is now the most recently used
    cache.put(3, torch.zeros(10, 10))
    assert cache.get(1) is None and cache.get(0) is not None and len(cache) == 3
    cache.put(4, torch.zeros(40, 10))  # larger than the whole budget: not kept
    assert cache.get(4) is None and len(cache) == 3


def test_bf16_model_without_onednn_bf16_runs_its_tower_in_float32(setup: Setup, monkeypatch) -> None:
    """Where oneDNN has no bf16 kernels (forced here on any CPU), a bf16 model builds its vision tower
    and projector in float32: their matmuls have hundreds of patch rows, where emulated bf16 is
    several times slower. The float32 checkpoint loads into them unrounded, so the features are the
    float32 model's rounded once to bf16 (equal bits), and the language model stays bf16."""
    from rxf.plugins.quantization import cpu_packing

    monkeypatch.setattr(cpu_packing, "onednn_bf16", lambda: False)
    path = setup.config.model.path
    bf16 = ModelRunner(load_config(setup.config, **{"model.dtype": "bfloat16"}),
                       PluginRegistry.load(), path).model
    assert {p.dtype for p in bf16.vision_tower.parameters()} == {torch.float32}
    assert {p.dtype for p in bf16.multi_modal_projector.parameters()} == {torch.float32}
    assert bf16.language_model.model.embed_tokens.weight.dtype == torch.bfloat16
    _, items = setup.ours(PROMPT, [image(*SIZES[0], seed=20)])
    with torch.inference_mode():
        ours = bf16.encode(items)[0]
        ref = setup.model.encode(items)[0]
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, ref.bfloat16())

    monkeypatch.setenv(cpu_packing.ENV, "0")  # packing off: the tower keeps the model's dtype
    plain = ModelRunner(load_config(setup.config, **{"model.dtype": "bfloat16"}),
                        PluginRegistry.load(), path).model
    assert {p.dtype for p in plain.vision_tower.parameters()} == {torch.bfloat16}
