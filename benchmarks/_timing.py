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


def run_paired(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, list]]:
    """:func:`alternate` with rotation, keeping each contender's per-round times (warm-up dropped):
    ``{name: (median seconds, [seconds of round 1, 2, ...])}``, for paired ratios."""
    times: dict[str, list[float]] = {name: [] for name in contenders}

    def record(name, fn):
        def call():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

        return call

    medians = alternate({n: record(n, f) for n, f in contenders.items()}, repeats, rotate=True)
    return {name: (medians[name], times[name][1:]) for name in contenders}


def ratio_row(model: str, case: str, native: tuple[float, list], ours: tuple[float, list]) -> str:
    """One table row: both medians in ms, their ratio and the median of the per-round ratios."""
    paired = statistics.median(b / a for a, b in zip(native[1], ours[1]))
    return (f"{model:8s} {case:34s} {native[0] * 1e3:10.1f} {ours[0] * 1e3:11.1f} "
            f"{ours[0] / native[0]:7.3f} {paired:7.3f}")  # fmt: skip
