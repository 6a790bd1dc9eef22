"""Tiny random-weight Hugging Face checkpoints (model + tokenizer) for tests across rxf.

`make_tiny_checkpoint` writes a directory that `transformers` and rxf both load: config.json,
generation_config.json, model.safetensors and a byte-level BPE tokenizer with a chatml template.
Weights are random but deterministic in `seed`; norm weights and biases are perturbed away from the
library's 1/0 initialisation so that a loader which drops them is caught by a logits comparison.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    # Far above the usual 0.02: logits then spread over several units, so greedy generation from a
    # random model is varied (it exercises positions and attention) instead of repeating one token.
    "initializer_range": 0.25,
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun.",
    "A language model predicts the next token from the tokens before it, one step at a time.",
    "Serving engines batch many requests together and reuse the cached keys and values of shared prefixes.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
    "How are you today? I am fine, thank you. What would you like to talk about?",
    "Numbers like 0, 1, 2, 3, 42, 100 and 2024 appear in text, as do dates such as 12/31/1999.",
    "Once upon a time, in a small village by the river, there lived an old baker and her curious son.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Please summarize the following paragraph in one sentence, keeping the important details.",
    "The weather report says it will rain tomorrow morning and clear up by the evening.",
    "你好，世界！今天天气很好，我们一起去公园散步吧。",
    "机器学习模型需要大量的数据来训练，推理服务需要高效的内存管理。",
    "我喜欢读书、写字和听音乐。你呢？",
    "Emoji are text too: 😀 🎉 🚀 ❤️ 👍 🌍 🍕 — and so is “curly quoted” punctuation…",
    "Mixed text: hello 世界 🌏, cache hits 命中 and misses 未命中.",
]


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE on the built-in corpus (cached: tests build many checkpoints)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeated with variations so that enough distinct pairs exist to reach vocab_size merges.
    corpus = [f"{line} {i}" for i in range(4) for line in _CORPUS]
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        logger.debug("tiny tokenizer reached %d of %d tokens", tok.get_vocab_size(), vocab_size)
    return tok.to_str()


def make_tiny_tokenizer(vocab_size: int = 512) -> Any:
    """A `PreTrainedTokenizerFast` whose ids are all below `vocab_size` (specials are 0..4)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHATML_TEMPLATE,
    )


def _model_type(arch: str) -> str:
    """The model_type whose own config class names `arch` (several types reuse LlamaForCausalLM)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    matches = [t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == arch]
    if not matches:
        raise ValueError(f"{arch} is not a transformers causal-LM architecture")
    own_config = arch.removesuffix("ForCausalLM") + "Config"
    return next((t for t in matches if CONFIG_MAPPING_NAMES.get(t) == own_config), matches[0])


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "LlamaForCausalLM",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `arch` into `path` (created) and return it.

    `config_overrides` go to the config class on top of `TINY_DEFAULTS`, e.g.
    `head_dim=32`, `attention_bias=True`, `tie_word_embeddings=True`, `sliding_window=None`,
    `rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, ...}`, and for
    `MixtralForCausalLM` (per-expert `block_sparse_moe.experts.{e}.w1/w2/w3` tensors, random router)
    `num_local_experts=6`, `num_experts_per_tok=3` (transformers' defaults: 8 experts, top 2).
    config.eos_token_id is `</s>`; generation_config.json lists `</s>` and `<|im_end|>`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(int(config_overrides.get("vocab_size", TINY_DEFAULTS["vocab_size"])))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    kwargs = {
        **TINY_DEFAULTS,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        **config_overrides,
    }
    config = AutoConfig.for_model(_model_type(arch), architectures=[arch], **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomize_biases_and_norms(model)
    model.generation_config.eos_token_id = [ids[EOS], ids[IM_END]]
    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def randomize_biases_and_norms(model: torch.nn.Module) -> None:
    """transformers initialises biases to 0 and norm weights to 1; drawing them around those values
    makes a test fail when a model ignores or mis-loads one."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)


def add_sentence_transformers_config(path: str | Path, pooling: str = "lasttoken", normalize: bool = True) -> Path:
    """Make the checkpoint at `path` a sentence-transformers embedding model, as Qwen3-Embedding
    ships: modules.json (Transformer, Pooling, and Normalize when `normalize`) and the Pooling
    module's config with `pooling_mode_<pooling>` set ("lasttoken", "mean_tokens", "cls_token")."""
    import json

    path = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    config = {f"pooling_mode_{mode}": mode == pooling for mode in modes} | {"include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return path


def make_tiny_eagle3_head(
    path: str | Path,
    target: str | Path,
    *,
    seed: int = 0,
    draft_vocab_size: int = 128,
    own_embedding: bool = False,
    std: float = 0.25,
    **config_overrides: Any,
) -> Path:
    """Write a random EAGLE-3 head for the checkpoint `target` into `path` (created) in the layout
    the public heads ship (`rxf/plugins/models/llama_eagle3.py`): config.json with architectures
    `LlamaForCausalLMEagle3`, one layer of the target's sizes and `draft_vocab_size`, and
    model.safetensors with `midlayer.*`, `fc`, `norm`, `lm_head` over a draft vocabulary of
    `draft_vocab_size` random target ids (ascending), `d2t` / `t2d` for it, and `embed_tokens`
    when `own_embedding`. Weights ~ N(0, std), norms ~ N(1, 0.1). `config_overrides` go into
    config.json (e.g. `eagle_aux_hidden_state_layer_ids=[0, 1, 1]`).
    """
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = json.loads((Path(target) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_parameters", "rope_scaling", "vocab_size", "max_position_embeddings", "hidden_act",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = {k: base[k] for k in keep if k in base} | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False, **config_overrides,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale + mean

    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": rand(hidden, mean=1.0, scale=0.1),
        "midlayer.hidden_norm.weight": rand(hidden, mean=1.0, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": rand(hidden, mean=1.0, scale=0.1),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": rand(hidden, mean=1.0, scale=0.1),
        "lm_head.weight": rand(draft_vocab_size, hidden),
    }
    hot = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    tensors["d2t"] = hot - torch.arange(draft_vocab_size)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True)
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden)
    save_file(tensors, str(path / "model.safetensors"))
    return path
