"""Checks on a live `Runtime` for tests: it let go of every request and KV slot."""

from __future__ import annotations

import time
from typing import Any


def assert_drained(rt: Any, timeout_s: float = 10.0) -> Any:
    """Wait (up to `timeout_s`) until `rt` runs nothing, then assert that nothing waits and that
    every KV slot is free or held by the radix tree (none leaked). Returns the final stats."""
    deadline = time.monotonic() + timeout_s
    while (stats := rt.get_stats()).num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.free_slots + stats.tree_slots == stats.total_slots, stats  # nothing leaked
    return stats
