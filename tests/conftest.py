"""Session-wide settings for rxf's own tests."""

from __future__ import annotations

import os


def pytest_configure() -> None:
    # No background compile of the whole CPU decode forward in the engines the tests build (each
    # would keep a core busy for seconds to minutes, and one is compiled per model): the tests that
    # check it ask for it by keyword, which outranks the environment. Servers inherit it.
    os.environ.setdefault("RXF_RUNTIME__CPU_COMPILE", "off")
