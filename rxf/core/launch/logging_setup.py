"""Logging for rxf's processes: one format, the process role in every line."""

from __future__ import annotations

import logging


def setup_logging(level: str = "info", prefix: str = "main") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
