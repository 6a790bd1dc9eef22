"""Building blocks shared by rxf's model plugins (DESIGN §6)."""

from __future__ import annotations

from rxf.plugins.models.layers.activation import SiluAndMul
from rxf.plugins.models.layers.attention import RadixAttention
from rxf.plugins.models.layers.embedding import LogitsHead, VocabEmbedding
from rxf.plugins.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorLayout,
)
from rxf.plugins.models.layers.norm import RMSNorm
from rxf.plugins.models.layers.rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "ColumnParallelLinear",
    "LogitsHead",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RMSNorm",
    "RadixAttention",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "TensorLayout",
    "VocabEmbedding",
    "rope_parameters",
]
