"""Helpers for testing rxf and its plugins: tiny checkpoints that load in transformers and rxf."""

from __future__ import annotations

from rxf.testing.checkpoints import make_tiny_checkpoint, make_tiny_tokenizer

__all__ = ["make_tiny_checkpoint", "make_tiny_tokenizer"]
