"""`load_tokenizer` gives AutoTokenizer's tokenizer without importing the model's config class."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from rxf.core.load_tokenizer import load_tokenizer
from rxf.testing.checkpoints import _CORPUS, make_tiny_tokenizer

# Model types whose checkpoints rxf serves, a composite (vision) one among them.
MODEL_TYPES = ["llama", "mistral", "qwen3", "qwen3_moe", "gemma3_text", "gemma3", "phi3", "gpt_oss", "llava"]


def _checkpoint(root: Path, model_type: str) -> Path:
    path = root / model_type
    AutoConfig.for_model(model_type).save_pretrained(path)
    make_tiny_tokenizer(256).save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_tokenizer_is_autotokenizers(tmp_path: Path, model_type: str) -> None:
    path = str(_checkpoint(tmp_path, model_type))
    ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(ref)
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.chat_template == ref.chat_template
    for text in _CORPUS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_directory_without_config(tmp_path: Path) -> None:
    make_tiny_tokenizer(256).save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).get_vocab() == AutoTokenizer.from_pretrained(str(tmp_path)).get_vocab()


def test_it_imports_no_model_config_module(tmp_path: Path) -> None:
    # The point of it: AutoConfig's llama module imports torch.distributed.tensor (~0.9 s of CPU).
    path = str(_checkpoint(tmp_path, "llama"))
    code = (
        "import sys; from rxf.core.load_tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print(__import__('json').dumps(sorted(m for m in sys.modules if m.startswith(('torch.distributed.tensor', "
        "'transformers.models.llama')))))"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == []
