"""The verdict line shared by the fault-injection scripts (benchmarks/fault_injection_*.py)."""

from __future__ import annotations

import argparse


def arguments(doc: str, policy: bool = True) -> argparse.Namespace:
    """--steps (10,000), --rate of injected faults (0.05) and, where the script has a choice, --policy."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=0.05)
    if policy:
        parser.add_argument("--policy", default="fp16-mixed")
    return parser.parse_args()


def verdict(label: str, injected: int, skipped: int, nonfinite: int, scales: list[float], ls,
            seconds: float, extra_ok: bool = True) -> int:  # fmt: skip
    """Print the counts and the scale range; 0 when nothing non-finite got through, every injected
    step (and only those) was skipped, and the scale stayed within [min_scale, max_scale]."""
    ok = nonfinite == 0 and skipped == injected and extra_ok
    ok = ok and ls.min_scale <= min(scales) and max(scales) <= ls.max_scale
    print(
        f"{label}, {injected} injected, {skipped} skipped, {nonfinite} non-finite elements, "
        f"scale range [{min(scales):g}, {max(scales):g}] within [{ls.min_scale:g}, {ls.max_scale:g}], "
        f"{seconds:.1f} s -> {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1
