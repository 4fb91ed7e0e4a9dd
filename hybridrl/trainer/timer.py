"""One timer for the phases of a step: ``with timer.phase("rollout"): ...``.

Seconds add up per phase name (a phase entered twice, e.g. refill rounds of DAPO
dynamic sampling, counts both times); no hand corrections anywhere else.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class PhaseTimer:
    def __init__(self, phases: tuple[str, ...] = ()):
        self.seconds: dict[str, float] = {p: 0.0 for p in phases}  # fixed keys: every step logs every phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
