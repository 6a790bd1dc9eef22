"""`HealthProbe`: GET /health every few milliseconds from a thread while a test does something to
the server, recording when each probe was sent, how long it took and what it got.

    with HealthProbe(url) as probe:
        ...                                   # load the server
    assert probe.max_latency_s() < 0.1
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Probe:
    sent: float  # time.monotonic()
    latency_s: float
    status: int | None  # None: no answer (refused, reset, timed out)


class HealthProbe:
    def __init__(self, url: str, interval_s: float = 0.01, timeout_s: float = 5.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.probes: list[Probe] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout_s) as client:  # one kept-alive connection
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    status: int | None = client.get("/health").status_code
                except httpx.HTTPError:
                    status = None
                self.probes.append(Probe(sent, time.monotonic() - sent, status))
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthProbe:
        # The probe's thread times requests from the test's own process: a collection of its heap
        # (large late in a test session) would stall it and count as the server's latency. Frozen
        # objects are left out of collections until __exit__.
        gc.freeze()
        self._thread.start()
        while not self.probes and self._thread.is_alive():  # the connection is up before the block runs
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1)
        gc.unfreeze()

    def max_latency_s(self) -> float:
        return max(p.latency_s for p in self.probes)

    def first_answer(self, status: int | None, after: float = 0.0) -> Probe | None:
        """The first probe sent after `after` (time.monotonic()) that got `status`."""
        return next((p for p in self.probes if p.sent >= after and p.status == status), None)
