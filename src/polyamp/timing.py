"""Paired timing: the policies of one (framework, workload) stepped in interleaved rounds.

``run_rounds``: each policy takes one warm-up step (step 0, not timed into a round); then round r
(r = 1, 2, ...) steps every policy still running once, on step r, in an order rotated by r so that
none always goes first. A policy leaves after the step on which its own seconds passed the budget
(a smoke check, ``count_warmup=False``, leaves its warm-up out of that sum), except that before
``min_rounds`` rounds it goes on up to ``EXTENSION`` budgets, so that a ratio rests on enough
rounds unless the policy is pathologically slow; or it leaves when its step raised. Leaving never
stops another policy: a capped case never caps its baseline. As policies
leave and never come back, policy p's timed steps are rounds 1..n_p and two policies share a
prefix of rounds.

``paired_ratio``: a case's speed-up over its baseline is the median over their shared rounds of
(baseline seconds / case seconds); its 95 % interval is the 2.5th and 97.5th percentiles of the
medians of 2000 bootstrap resamples of those per-round ratios (a fixed seed, so a report is
reproducible from its records). With no shared round (a policy that spent its budget on its
warm-up) the speed-up is the baseline's median over the case's warm-up step, marked unpaired.
"""

from __future__ import annotations

import math
import statistics
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
MIN_ROUNDS = 5
EXTENSION = 3  # budgets a policy may spend to reach MIN_ROUNDS
# how the policies of a row shared the machine while they were timed
IN_PROCESS = "rounds in one process"
LOCKSTEP = "rounds across processes"  # MXNet: contrib.amp is process-wide, one process per policy
WARMUP_ONLY = "unpaired: warm-up step only"


class CaseError(Exception):
    """A step that failed where it ran (a worker process): the status and error text recorded there."""

    def __init__(self, status: str, error: str, remote_traceback: str | None = None):
        super().__init__(error)
        self.status, self.error, self.remote_traceback = status, error, remote_traceback


@dataclass
class PolicyTimes:
    """What the rounds gave one policy: its warm-up and round seconds, and why it left early."""

    warmup_s: float | None = None
    times: list[float] = field(default_factory=list)  # round 1, 2, ...
    cap_reason: str | None = None
    status: str = "ok"  # else "failed", "unsupported" or "timeout": its step raised
    error: str | None = None
    traceback: str | None = None

    @property
    def steps(self) -> int:
        return len(self.times) + (self.warmup_s is not None)

    @property
    def spent(self) -> float:
        return (self.warmup_s or 0.0) + sum(self.times)


@dataclass(frozen=True)
class PairedRatio:
    """A speed-up over the baseline: median of per-round ratios, its 95 % interval, its rounds."""

    speedup: float
    ci95: tuple[float, float] | None
    rounds: int
    baseline: str
    pairing: str

    def to_json(self) -> dict:
        out = asdict(self)
        out["ci95"] = list(self.ci95) if self.ci95 else None
        return out


def run_rounds(steppers: Mapping[str, Callable[[int], float]], steps: int, budget: float,
               count_warmup: bool = True, min_rounds: int = MIN_ROUNDS) -> dict[str, PolicyTimes]:
    """Step every policy ``steps`` times (one warm-up, then rounds); ``steppers[p](i)`` runs policy
    p's step i and returns its seconds. Returns each policy's times, in the order of ``steppers``."""
    result = {name: PolicyTimes() for name in steppers}
    active = list(steppers)

    def take(name: str, i: int) -> None:
        out = result[name]
        try:
            seconds = float(steppers[name](i))
        except CaseError as err:  # the policy leaves; the others go on
            out.status, out.error, out.traceback = err.status, err.error, err.remote_traceback
            active.remove(name)
            return
        except Exception as err:
            out.status = "unsupported" if getattr(err, "unsupported", False) else "failed"
            out.error, out.traceback = f"{type(err).__name__}: {err}", traceback.format_exc(limit=8)
            active.remove(name)
            return
        if i == 0:
            out.warmup_s = seconds
        else:
            out.times.append(seconds)
        spent = out.spent if count_warmup else sum(out.times)
        short = len(out.times) < min_rounds
        if spent > (EXTENSION * budget if short else budget) and i + 1 < steps:
            limit = f"{EXTENSION} budgets ({EXTENSION * budget:g} s) before {min_rounds} rounds" if short \
                else f"the {budget:g} s budget of a case"
            out.cap_reason = (f"stopped after {i + 1} of {steps} steps: {limit} spent (this step took "
                              f"{seconds:.2f} s)")  # fmt: skip
            active.remove(name)

    for name in list(active):
        take(name, 0)
    for r in range(1, steps):
        if not active:
            break
        shift = r % len(active)
        for name in active[shift:] + active[:shift]:
            take(name, r)
    return result


def bootstrap_ci(ratios: list[float], resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """The 95 % percentile-bootstrap interval of the median of ``ratios``."""
    values = np.asarray(ratios, dtype=float)
    if len(values) == 1:
        return float(values[0]), float(values[0])
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, size=(resamples, len(values)), replace=True), axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return float(lo), float(hi)


def paired_ratio(base: PolicyTimes, case: PolicyTimes, baseline: str, pairing: str) -> PairedRatio | None:
    """The case's speed-up over ``base`` (see the module docstring), or None without times."""
    ratios = [b / c for b, c in zip(base.times, case.times) if c > 0 and math.isfinite(b / c)]
    if ratios:
        return PairedRatio(statistics.median(ratios), bootstrap_ci(ratios), len(ratios), baseline, pairing)
    if base.times and case.warmup_s and not case.times:
        return PairedRatio(statistics.median(base.times) / case.warmup_s, None, 0, baseline, WARMUP_ONLY)
    return None


def paired_ratios(times: Mapping[str, PolicyTimes], baseline: str, pairing: str) -> dict[str, PairedRatio]:
    """Every policy's ratio over ``baseline`` (absent when the baseline did not run or failed)."""
    base = times.get(baseline)
    if base is None or base.status != "ok":
        return {}
    out = {}
    for name, case in times.items():
        if name != baseline and case.status == "ok":
            ratio = paired_ratio(base, case, baseline, pairing)
            if ratio is not None:
                out[name] = ratio
    return out

