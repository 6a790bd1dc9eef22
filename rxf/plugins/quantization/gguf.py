"""`gguf`: a Llama-architecture GGUF (llama.cpp's file) served from its own 4-bit blocks.

`model.quantization = "gguf"` on a Hugging Face directory (config.json, tokenizer) that also holds
exactly one `.gguf` file of the same model (the demo's cache directory is one): the weights are
read from the GGUF with the `gguf` package instead of the directory's safetensors.

Tensors stored as Q4_0 or Q4_1 keep their 4-bit codes. A block holds 32 consecutive inputs of one
output row: Q4_0 `{fp16 d; u8 qs[16]}`, `w = (q - 8) * d`; Q4_1 `{fp16 d; fp16 m; u8 qs[16]}`,
`w = q * d + m`; input j of the block is the low nibble of `qs[j]` for j < 16 and the high nibble of
`qs[j - 16]` after. They load as codes `[N, K]` with per-block `scales` d and `mins` m (Q4_0:
m = -8 d) and are packed for torch's int4 matmul on the CPU in groups of 32 (`cpu_packing.py`:
scale d, offset m + 8 d), never through float32. A fused layer (qkv, gate_up) keeps 4-bit codes
only when all its projections are Q4_0 / Q4_1; every other tensor (Q8_0, Q6_K, F16, F32, ...) is
dequantized by the `gguf` package as transformers' GGUF loader does, and loads as usual; the logits
head (the demo's is its Q8_0 embedding, tied) then computes in int8 per row (`online_int.Int8Head`:
its Q8_0 values requantized with one scale per row instead of per block of 32, the embedding
lookup keeps them as they are).

llama.cpp's converter permutes the rows of each attention head of q and k (its rope rotates
adjacent pairs, Hugging Face's rotates halves): rows are put back into Hugging Face's order here,
a whole row with its blocks. Without packing (`RXF_CPU_WEIGHT_PACKING=0`, CUDA, a layer the op cannot
take) the codes are dequantized at load to `q * d + m` in float32, bit for bit what the `gguf`
package (and so transformers) computes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from rxf.core.quantization import QuantizationMethod
from rxf.plugins.models.layers.linear import TensorLayout
from rxf.plugins.quantization import cpu_packing
from rxf.plugins.quantization.base import FUSED_PARTS, LinearMethod, become_dense, checkpoint_names
from rxf.plugins.quantization.online_int import Int8Head

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per Q4_0 / Q4_1 block
# GGUF's standardized tensor names (ggml's docs/gguf.md) for the Llama architecture, and Hugging Face's.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_SKIPPED = ("rope_freqs",)  # rope comes from config.json
_QUANT_PARAMS = ("qweight", "scales", "mins")


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: a tensor rxf skips);
    an unknown name is returned as it is, for the loader to report."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] in _SKIPPED:
        return None
    if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return gguf_name


def _fused_group(module_name: str) -> list[str]:
    """The checkpoint projections fused with `module_name` in one rxf layer (itself included)."""
    head, _, last = module_name.rpartition(".")
    for parts in FUSED_PARTS.values():
        if last in parts:
            return [f"{head}.{p}" for p in parts]
    return [module_name]


def _unpermute_rope_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q / k row order -> Hugging Face's: within each head, GGUF row 2i + j is Hugging
    Face row j * (head_dim / 2) + i."""
    return t.reshape(heads, -1, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def unpack_q4_blocks(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw Q4_0 / Q4_1 bytes `[N, K / 32 * block_bytes]` -> (codes uint8 `[N, K]`, d, m fp16 `[N, K / 32]`).
    In numpy, as the `gguf` package hands the bytes over: one thread, no torch dispatch per op."""
    header = 2 if kind == "Q4_0" else 4
    blocks = raw.reshape(raw.shape[0], -1, header + 16)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = -8 * d if kind == "Q4_0" else np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    qs = blocks[..., header:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # inputs 0..15 low nibbles, 16..31 high
    return torch.from_numpy(codes.reshape(raw.shape[0], -1)), torch.from_numpy(d), torch.from_numpy(m)


class GgufMethod(LinearMethod):
    name = "gguf"
    packed_kinds = ("Q4_0", "Q4_1")

    def __init__(self, quant_config: dict[str, Any] | None, dtype: torch.dtype) -> None:
        super().__init__(quant_config, dtype)
        if quant_config is not None:
            raise ValueError(f"model.quantization 'gguf' reads a .gguf file beside an unquantized checkpoint's config; "
                             f"this checkpoint is quantized with {quant_config.get('quant_method')!r}")
        self.four_bit: set[str] = set()  # checkpoint modules stored in Q4_0 / Q4_1 with their fused siblings
        self.taken: set[str] = set()  # those a layer of the model took over (`quantizes`): they keep their codes

    def checkpoint_weights(self, model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf

        files = sorted(Path(model_path).glob("*.gguf"))
        if len(files) != 1:
            raise FileNotFoundError(f"model.quantization 'gguf': {model_path} must hold exactly one .gguf file, found "
                                    f"{len(files)} ({', '.join(f.name for f in files) or 'none'})")
        reader = gguf.GGUFReader(files[0])
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"model.quantization 'gguf': {files[0].name} is a {arch!r} model; only 'llama' GGUFs "
                             "(Llama, Mistral, SmolLM) are read")
        heads = {"attn_q": _field(reader, "llama.attention.head_count"),
                 "attn_k": _field(reader, "llama.attention.head_count_kv")}
        kinds = {name.removesuffix(".weight"): t.tensor_type.name for t in reader.tensors
                 if (name := hf_name(t.name)) is not None}
        self.four_bit = {name for name in kinds
                         if all(kinds.get(p) in self.packed_kinds for p in _fused_group(name))}
        logger.info("gguf: %s, %d tensors (%d kept in 4 bits)", files[0].name, len(reader.tensors), len(self.four_bit))
        return self._stream(reader, heads)

    def _stream(self, reader: Any, heads: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        for t in tqdm(reader.tensors, desc="Loading weights", unit="tensor", dynamic_ncols=True):
            name = hf_name(t.name)
            if name is None:
                continue
            kind = next((k for k in heads if f".{k}." in t.name), None)
            permute = (lambda x, h=heads[kind]: _unpermute_rope_rows(x, h)) if kind else (lambda x: x)
            module = name.removesuffix(".weight")
            if module in self.taken:  # the stream runs after `materialize`, so this set is complete
                codes, d, m = unpack_q4_blocks(t.data, t.tensor_type.name)
                yield f"{module}.qweight", permute(codes)
                yield f"{module}.scales", permute(d)
                yield f"{module}.mins", permute(m)
            else:
                shape = [int(s) for s in reversed(t.shape)]  # GGUF lists dimensions innermost first
                dense = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(shape)  # writable
                yield name, permute(dense.float())

    def quantizes(self, module: nn.Module, name: str) -> bool:
        names = checkpoint_names(name)
        taken = super().quantizes(module, name) and all(n in self.four_bit for n in names)
        if taken:
            self.taken.update(names)
        return taken

    def quantizes_experts(self, name: str) -> bool:
        return False  # Llama GGUFs hold no experts

    def after_load(self, module: nn.Module, name: str) -> QuantizationMethod | None:
        return Int8Head(None, self.dtype)

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.out_per_rank, layer.in_per_rank
        if k % BLOCK:
            raise ValueError(f"gguf: a layer of {k} inputs per rank does not fit blocks of {BLOCK} inputs")
        layer.add_param("qweight", torch.empty(n, k, dtype=torch.uint8), TensorLayout(dtypes=(torch.uint8,)))
        block_layout = TensorLayout(in_pack=BLOCK, dtypes=(torch.float16,))
        layer.add_param("scales", torch.empty(n, k // BLOCK, dtype=torch.float16), block_layout)
        layer.add_param("mins", torch.empty(n, k // BLOCK, dtype=torch.float16), block_layout)
        del layer.weight

    def process_loaded(self, layer: nn.Module) -> None:
        codes, d, m = layer.qweight.data, layer.scales.data.float(), layer.mins.data.float()
        kernel_group = None if codes.is_cuda else cpu_packing.int4_kernel_group(layer.out_per_rank, layer.in_per_rank, BLOCK)
        if kernel_group is None:
            dense = codes.float() * d.repeat_interleave(BLOCK, 1) + m.repeat_interleave(BLOCK, 1)
            become_dense(layer, dense, _QUANT_PARAMS)
            return
        for name in _QUANT_PARAMS:
            delattr(layer, name)
        offsets = m + 8 * d  # the op's (q - 8) * d + offset
        cpu_packing.set_packed_int4(layer, codes, torch.stack([d.t(), offsets.t()], dim=-1),
                                    kernel_group)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_packing.packed_int4_linear(layer, x, bias)


def _field(reader: Any, key: str) -> Any:
    """A scalar or string metadata value of the GGUF (read from its parts: `ReaderField.contents()`
    is newer than the gguf>=0.10 rxf requires)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"model.quantization 'gguf': the GGUF has no {key} metadata")
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value.item()
