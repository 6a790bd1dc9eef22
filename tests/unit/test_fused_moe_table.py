"""The fused MoE kernels' table of tuned block sizes (`fused_moe_table`) and the kernels at Qwen3-MoE's
routing (128 experts, top 8) on CPU under the Triton interpreter, against the torch path.

- The table: written and read back, nearest token count in log2, malformed entries named, and the
  shipped file valid.
- `fused_experts` reads it: an entry for the problem's shape on this device ("cpu" under the
  interpreter) is the config the call uses.
- Every config of the shipped table, run on a tiny 128-expert top-8 problem, matches the torch path
  (a tuned config must never change results, only speed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fused_moe import assert_matches, problem, reference  # sets TRITON_INTERPRET first

from rxf.plugins.models.layers import fused_moe, fused_moe_table
from rxf.plugins.models.layers.fused_moe import BlockConfig, fused_experts
from rxf.plugins.models.layers.fused_moe_table import FIELDS, load_table, lookup, table_key, write_entries

BLOCKS = {"block_m": 16, "block_n": 32, "block_k": 64, "down_block_n": 16, "group_m": 1, "num_warps": 4,
          "num_stages": 2}


def test_round_trip_and_nearest_token_count(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_text('{"other": {"4": ' + str(BLOCKS).replace("'", '"') + "}}")
    key = table_key(128, 768, 2048, torch.bfloat16, "NVIDIA H200")
    assert key == "E=128,N=768,K=2048,dtype=bfloat16,device=NVIDIA H200"
    buckets = {m: {**BLOCKS, "block_m": bm} for m, bm in ((1, 16), (8, 16), (64, 32), (4096, 128))}
    write_entries(key, buckets, path)
    assert set(load_table(path)) == {"other", key}  # the other key is kept
    picks = {t: lookup(key, t, path)["block_m"] for t in (1, 2, 3, 5, 20, 23, 200, 512, 600, 9999)}
    # In log2: 20 is nearer 8 (1.32) than 64 (1.68), 23 nearer 64; 512 ties 64 and 4096 (3 each): the larger.
    assert picks == {1: 16, 2: 16, 3: 16, 5: 16, 20: 16, 23: 32, 200: 32, 512: 128, 600: 128, 9999: 128}
    assert lookup("E=1,N=1,K=1,dtype=float32,device=cpu", 4, path) is None
    assert len(path.read_text().splitlines()) == 2 + 2 * 2 + 4 + 1  # one line per token count


@pytest.mark.parametrize(("bad", "message"), [
    ({**BLOCKS, "block_n": 48}, "block_n 48 is not a power of two"),
    ({k: v for k, v in BLOCKS.items() if k != "group_m"}, "expected exactly the fields"),
    ({**BLOCKS, "num_warps": 0}, "num_warps 0 is not a positive integer"),
])
def test_malformed_entries_are_named(tmp_path: Path, bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_entries("k", {4: bad}, tmp_path / "t.json")
    path = tmp_path / "t2.json"
    path.write_text('{"E=8": {"16": ' + str(bad).replace("'", '"') + "}}")
    with pytest.raises(ValueError, match=f"t2.json: E=8: 16: .*{message}"):
        load_table(path)


def test_shipped_table_is_valid() -> None:
    for key, buckets in load_table(fused_moe_table.TABLE_FILE).items():
        assert key.startswith("E=") and all(set(b) == set(FIELDS) for b in buckets.values())


def test_fused_experts_uses_the_table_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, w13, w2, weights, ids = problem(5, 128, 8, 32, 16, torch.float32)
    path = tmp_path / "table.json"
    write_entries(table_key(128, 16, 32, torch.float32, "cpu"), {4: {**BLOCKS, "block_m": 32}}, path)
    monkeypatch.setattr(fused_moe_table, "TABLE_FILE", path)
    lookup.cache_clear()
    used = []
    real_align = fused_moe.align_pairs
    monkeypatch.setattr(fused_moe, "align_pairs", lambda ids_, e, bm: used.append(bm) or real_align(ids_, e, bm))
    try:
        assert fused_moe.tuned_config(5, w13, torch.float32) == BlockConfig(**{**BLOCKS, "block_m": 32})
        assert fused_moe.tuned_config(5, w13, torch.float16) is None  # another dtype: not in the table
        assert_matches(fused_experts(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids), torch.float32)
        assert used == [32]
    finally:
        lookup.cache_clear()


SHIPPED = [(key, m, BlockConfig(**b)) for key, buckets in load_table(fused_moe_table.TABLE_FILE).items()
           for m, b in buckets.items()]
SHIPPED_IDS = [f"{k}-{m}" for k, m, _ in SHIPPED]
if not SHIPPED:  # until benchmarks/gpu_moe_tune.py has written entries
    SHIPPED, SHIPPED_IDS = [pytest.param("", 0, None, marks=pytest.mark.skip(reason="the table has no entries"))], None


@pytest.mark.parametrize("tokens", [1, 6, 20])
def test_qwen3_moe_routing_matches_torch_path(tokens: int) -> None:
    """128 experts, top 8 (most experts unused at 1 token, most hit at 20), the default blocks."""
    x, w13, w2, weights, ids = problem(tokens, 128, 8, 64, 32, torch.float32, seed=tokens)
    assert_matches(fused_experts(x, w13, w2, weights, ids), reference(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize(("key", "tokens", "config"), SHIPPED, ids=SHIPPED_IDS)
def test_shipped_configs_match_torch_path(key: str, tokens: int, config: BlockConfig) -> None:
    x, w13, w2, weights, ids = problem(3, 128, 8, 64, 32, torch.float16, seed=tokens)
    assert_matches(fused_experts(x, w13, w2, weights, ids, config), reference(x, w13, w2, weights, ids),
                   torch.float16)
