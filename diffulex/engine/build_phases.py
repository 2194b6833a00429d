"""Where an engine's start goes: the wall time of ``Diffulex(...)`` split into consecutive phases.

A server's restart is a user's wait, so every second of it is named: the phases follow each other without gaps
(each ends where the next begins), from the imports ``Diffulex(...)`` makes on first use to the engine being
ready, and their sum is the wall time of the call. Work done in a background thread beside them (the tokenizer's
import while the weights load) is kept apart: it overlaps the phases, so it is not added to them.

This module imports nothing heavy: ``Diffulex(...)`` starts the clock before importing the engine.
"""

from __future__ import annotations

import time


class BuildPhases:
    """Consecutive phases of a build; logged as one line when ready."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = self._mark = time.perf_counter()

    def done(self, phase: str) -> None:
        """End `phase` now; the next phase starts here (a phase named twice adds up)."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    @property
    def total(self) -> float:
        """Seconds from the start to the end of the last phase: the sum of the phases."""
        return self._mark - self._start

    def summary(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())
        return f"engine ready in {self.total:.2f} s: {parts}"
