"""Tuned block sizes of the fused MoE kernels (`fused_moe.py`), read from `fused_moe_tuned.json`.

The table is keyed by shape, dtype and GPU, as the kernels see them on one rank:

    "E=128,N=768,K=2048,dtype=bfloat16,device=NVIDIA H200": {"1": {...}, "2": {...}, ..., "4096": {...}}

E experts, N the expert width on this rank (`moe_intermediate_size / tp_size`), K the hidden size,
the device as `torch.cuda.get_device_name()` says it ("cpu" for CPU tensors, which only the Triton
interpreter runs). Each entry maps a token count it was tuned at to `fused_moe.BlockConfig`'s fields.
A call with T tokens takes the entry tuned nearest T in log2 (ties to the larger count); a shape or
GPU the table lacks gets `fused_moe.pick_config`'s heuristic. `benchmarks/gpu_moe_tune.py` writes
the entries (it keeps the other keys of the file), one at every token count it tuned, so that a
count between two takes a measured neighbour. No torch or triton import: this is plain data.

Shipped: Qwen3-30B-A3B's layer in bf16 on the H100 (2026-12-06, benchmarks/RESULTS.md): the blocks
the search found at 2, 4, 8, 512 and 4096 tokens (1.02-1.11x the heuristic's), the heuristic's own at
1, 16-256 and 1024, where nothing beat it by 2%.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

TABLE_FILE = Path(__file__).with_name("fused_moe_tuned.json")
FIELDS = ("block_m", "block_n", "block_k", "down_block_n", "group_m", "num_warps", "num_stages")
_BLOCKS = ("block_m", "block_n", "block_k", "down_block_n")  # tl.dot tiles: powers of two >= 16


def table_key(num_experts: int, inter: int, hidden: int, dtype: Any, device_name: str) -> str:
    return f"E={num_experts},N={inter},K={hidden},dtype={str(dtype).removeprefix('torch.')},device={device_name}"


def _check_entry(where: str, blocks: Any) -> dict[str, int]:
    if not isinstance(blocks, dict) or set(blocks) != set(FIELDS):
        raise ValueError(f"{where}: expected exactly the fields {', '.join(FIELDS)}, got {blocks!r}")
    for name, value in blocks.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name} {value!r} is not a positive integer")
        if name in _BLOCKS and (value < 16 or value & (value - 1)):
            raise ValueError(f"{where}: {name} {value} is not a power of two >= 16")
    return blocks


@functools.cache
def load_table(path: Path = TABLE_FILE) -> dict[str, dict[int, dict[str, int]]]:
    """The file's entries, checked (a malformed one raises ValueError naming it); {} if absent."""
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    table: dict[str, dict[int, dict[str, int]]] = {}
    for key, buckets in raw.items():
        if not isinstance(buckets, dict) or not buckets:
            raise ValueError(f"{path}: {key}: expected a non-empty object of token counts")
        table[key] = {}
        for tokens, blocks in buckets.items():
            if not tokens.isdigit() or int(tokens) < 1:
                raise ValueError(f"{path}: {key}: {tokens!r} is not a token count")
            table[key][int(tokens)] = _check_entry(f"{path}: {key}: {tokens}", blocks)
    return table


@functools.lru_cache(maxsize=4096)
def lookup(key: str, num_tokens: int, path: Path | None = None) -> dict[str, int] | None:
    """The blocks tuned nearest `num_tokens` for `key` in `path` (default `TABLE_FILE`), or None when
    the table has no such key."""
    buckets = load_table(path or TABLE_FILE).get(key)
    if not buckets:
        return None
    target = math.log2(max(num_tokens, 1))
    return buckets[min(buckets, key=lambda m: (abs(math.log2(m) - target), -m))]


def write_entries(key: str, buckets: dict[int, dict[str, int]], path: Path = TABLE_FILE) -> None:
    """Replace `key`'s entries in the file (created if absent), keeping every other key; one token
    count per line so that a re-tune reads as a small diff."""
    for tokens, blocks in buckets.items():
        _check_entry(f"{key}: {tokens}", blocks)
    raw = json.loads(path.read_text()) if path.is_file() else {}
    raw[key] = {str(m): {f: buckets[m][f] for f in FIELDS} for m in sorted(buckets)}
    lines = ["{"]
    for i, k in enumerate(sorted(raw)):
        lines.append(f"  {json.dumps(k)}: {{")
        rows = [f"    {json.dumps(m)}: {json.dumps(b)}" for m, b in sorted(raw[k].items(), key=lambda kv: int(kv[0]))]
        lines.append(",\n".join(rows))
        lines.append("  }" + ("," if i < len(raw) - 1 else ""))
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")
    load_table.cache_clear()
    lookup.cache_clear()
