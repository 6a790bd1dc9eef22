"""Test-only fault injection: make the runner raise where real bugs would, for chosen requests.

`RXF_FAULT_INJECT="<point>:<marker>[,<point>:<marker>...]"` (read once when the scheduler starts;
unset means no injector at all) raises `InjectedFault` at `<point>` whenever a request whose rid
contains `<marker>` is involved:

- `sample`: while sampling a batch that holds such a request (the per-request recovery path);
- `forward`: in the model forward of a batch that holds such a request (the whole batch fails).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rxf.core.scheduler.req import Req

ENV_VAR = "RXF_FAULT_INJECT"
POINTS = ("sample", "forward")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class FaultInjector:
    faults: tuple[tuple[str, str], ...]  # (point, rid marker)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(ENV_VAR)
        if not spec:
            return None
        faults = []
        for item in spec.split(","):
            point, sep, marker = item.partition(":")
            if not sep or point not in POINTS or not marker:
                raise ValueError(f"{ENV_VAR}: expected '<{'|'.join(POINTS)}>:<rid marker>', got {item!r}")
            faults.append((point, marker))
        return cls(tuple(faults))

    def check(self, point: str, reqs: Iterable[Req]) -> None:
        rids = [r.rid for r in reqs]
        if any(p == point and marker in rid for p, marker in self.faults for rid in rids):
            raise InjectedFault(f"injected {point} fault")
