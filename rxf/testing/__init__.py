"""Helpers for testing rxf and its plugins: tiny checkpoints that load in transformers and rxf.

The names below are imported on first use: rxf's pytest plugin (`rxf.testing.pytest_plugin`) is
loaded by every pytest run in an environment that has rxf, and must not make them import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["make_tiny_checkpoint", "make_tiny_tokenizer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rxf.testing import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'rxf.testing' has no attribute {name!r}")
