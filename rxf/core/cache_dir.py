"""The user cache of rxf: the demo model's converted checkpoint, the CPU backend's built C++ ops."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$RXF_CACHE_DIR`, else `$XDG_CACHE_HOME/rxf`, else `~/.cache/rxf`."""
    if os.environ.get("RXF_CACHE_DIR"):
        return Path(os.environ["RXF_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rxf"
