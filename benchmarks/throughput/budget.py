"""The wall-clock budget of a run, and what it made the run skip."""

from __future__ import annotations

import time

from benchmarks.throughput.progress import say


class Budget:
    """Wall-clock budget of the whole run: optional stages (start-up rebuilds, extra
    repetitions, the Transformers backend in compile mode) are skipped, and said so,
    when what is left would not cover them."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds
        self.skipped: list[str] = []
        # compile start-up per decoder layer, the largest seen (a first guess before)
        self.compile_s_per_layer = 8.0

    def compile_estimate(self, layers: int) -> float:
        return self.compile_s_per_layer * layers

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, need_s: float, what: str, quiet: bool = False) -> bool:
        """Whether ``need_s`` seconds are left; if not, ``what`` is recorded as
        skipped (``quiet``: optional extras, not recorded)."""
        if self.left() >= need_s:
            return True
        if not quiet:
            self.skipped.append(what)
            say(f"skipped for time: {what}")
        return False
