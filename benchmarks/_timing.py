"""The timing loop shared by the benchmarks: contenders measured side by side in one process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(
    contenders: dict[str, Callable[[], object]], repeats: int, rotate: bool = False
) -> dict[str, float]:
    """Median seconds per call of each contender: one warm-up call each, then ``repeats`` rounds that
    call every contender in turn (each call must finish its work before returning). With
    ``rotate``, round r starts at the r-th contender, so none always runs first."""
    for fn in contenders.values():
        fn()
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
