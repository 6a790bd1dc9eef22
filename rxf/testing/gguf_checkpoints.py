"""A Llama checkpoint written as a GGUF, as llama.cpp's converter lays it out, for tests:

    write_gguf(src, dst, kinds={"ffn_down": "Q4_0"}, default="Q4_1", twin=twin_dir)

`dst`: `src`'s config and tokenizer plus `model.gguf`, whose projections are quantized by the
`gguf` package (`gguf.quants.quantize`) in `default` or the kind `kinds` gives their GGUF name
(`attn_q`, `ffn_down`, `blk.1.attn_v`, ...); norms stay F32, the embedding F16. q and k rows are
permuted per head as llama.cpp's converter does for its rope (pairs of adjacent rows). `twin`: an
unquantized float32 checkpoint holding exactly the values the GGUF encodes (`gguf.quants.dequantize`),
in Hugging Face's row order, for transformers to serve as the reference. The permutation is undone
there by inverting the converter's row index, independently of rxf's reader.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from rxf.testing.quantized_checkpoints import write_twin

_PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf)
    assert m is not None, hf
    return f"blk.{m[1]}.{({**_PROJECTIONS, **_NORMS})[m[2]]}.weight"


def converter_row_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's q / k permutation as a row index: GGUF row r holds Hugging Face row `order[r]`.
    Per head of 2h rows, the converter interleaves the two halves: row 2i + j <- j * h + i."""
    h = rows // heads // 2
    order = [head * 2 * h + j * h + i for head in range(heads) for i in range(h) for j in range(2)]
    return np.array(order)


def write_gguf(src: str | Path, dst: str | Path, *, kinds: dict[str, str] | None = None, default: str = "Q4_1",
               twin: str | Path | None = None) -> Path:
    import gguf
    from gguf.quants import dequantize, quantize

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"), dirs_exist_ok=True)
    writer = gguf.GGUFWriter(str(dst / "model.gguf"), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(heads["attn_q"])
    writer.add_head_count_kv(heads["attn_k"])
    dense: dict[str, torch.Tensor] = {}
    with safe_open(str(next(src.glob("*.safetensors"))), framework="pt") as f:
        for hf in f.keys():
            name = _gguf_name(hf)
            w = f.get_tensor(hf).float().numpy()
            part = name.split(".")[-2]
            order = converter_row_order(w.shape[0], heads[part]) if part in heads else None
            if order is not None:
                w = w[order]
            if name.endswith("norm.weight"):
                kind = "F32"
            elif name == "token_embd.weight":
                kind = "F16"
            else:
                kind = (kinds or {}).get(name.removesuffix(".weight"), (kinds or {}).get(part, default))
            qtype = gguf.GGMLQuantizationType[kind]
            stored = quantize(w, qtype)
            writer.add_tensor(name, stored, raw_dtype=qtype)
            encoded = dequantize(stored, qtype).reshape(w.shape)
            if order is not None:  # back to Hugging Face's rows: HF row order[r] is GGUF row r
                restored = np.empty_like(encoded)
                restored[order] = encoded
                encoded = restored
            dense[hf] = torch.from_numpy(np.ascontiguousarray(encoded, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if twin is not None:
        write_twin(src, twin, dense)
    return dst
