"""Programmatic dependent launch switched on or off for a block of a test (`rxf/core/runner/pdl.py`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rxf.core.runner import pdl


@contextlib.contextmanager
def pdl_env(on: bool) -> Iterator[None]:
    """RXF_PDL set for the block; `pdl` reads it once per device, so its cache is reset on entry and exit."""
    old = os.environ.get(pdl.ENV)
    os.environ[pdl.ENV] = "1" if on else "0"
    pdl._supported.cache_clear()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(pdl.ENV)
        else:
            os.environ[pdl.ENV] = old
        pdl._supported.cache_clear()
