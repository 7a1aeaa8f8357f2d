"""Side-by-side timing for the benchmarks: cases run in turn, round after round, so that the
machine's drift reaches each of them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Milliseconds per call of each case: ``warmup`` untimed rounds, then ``repeats`` timed
    rounds of every case in turn; the median of each."""
    for _ in range(warmup):
        for run in cases.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}
