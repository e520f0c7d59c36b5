"""The search: per policy, one knob at a time, each alternative checked for loss parity and then timed in
paired rounds against the configuration it would replace.

1. The float32 default is the reference: ``parity_steps`` steps from the shared initial weights give the
   reference loss ``L32`` (the last step's).
2. Each low-precision policy's default configuration is checked for parity first (a policy that
   fails is dropped with its reason). Then, knob by knob and value by value, for each policy in turn
   (so that a short budget tunes them alike), the alternative to the policy's current configuration:
   build it and step it ``parity_steps`` times (its first step also compiles and warms up). It fails
   if a step raises or a loss is not finite, breaks parity if its last loss differs from ``L32`` by
   more than ``rtol * |L32|``, and is *slower* without further timing when its second step takes
   over ``SLOW`` times the current one's. Otherwise both step on in rounds that alternate their order
   (``compare.timing.run_rounds``), and the alternative replaces the current configuration when the
   median of the per-round ratios (over at least ``MIN_CHOICE_ROUNDS`` rounds) is at least
   ``1 + min_gain`` and its 95 % bootstrap interval lies above 1. Every alternative is reported,
   whatever happened to it. Knobs interact (on a CPU, ``torch.compile`` gains little around flash
   attention and much around the math kernel), so while a pass has chosen something, another pass
   tries every knob value (defaults included) whose configuration with the current ones has not been
   tried yet, up to ``MAX_PASSES`` passes.
3. Three quarters of the budget (seconds of wall time) go to the search, the rest to the final rounds.
   A configuration is tried only if the longest build and parity check seen so far still fits; its
   timing rounds get an equal share of what is left after the builds still to come. The alternatives
   that do not fit are listed as not tried.
4. Finally every policy's default and tuned configurations (of the policies whose default kept
   parity) are stepped side by side in one set of rounds: each one's paired speed-up over the float32
   default, and the best tuned low-precision step over the best tuned float32 step, from the same
   rounds. A tuned configuration that these rounds find slower than its policy's default (the 95 %
   interval of default seconds / tuned seconds entirely below 1: choices that held in their own rounds
   but not together) is reverted to the default, and listed as a ``reverted`` trial with the figures.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..compare.timing import PolicyTimes, paired_ratio, run_rounds
from ..errors import PolyampError
from .report import Final, Trial, TuneReport
from .space import Candidate, Step, Tunable, check_policies, defaults

SLOW = 3.0  # an alternative whose second step takes this many times the current one's, and at least
SLOW_S = 1.0  # this many seconds, is slower without further timing (fp16 where a CPU has no fp16 units)
MAX_ROUNDS = 15
MIN_CHOICE_ROUNDS = 3  # paired rounds a choice rests on at least
MAX_PASSES = 3  # over the knobs, while the previous pass chose something
FINAL_SHARE = 0.25  # of the budget, kept for the final side-by-side rounds


def tune(tunable: Tunable, policies: Sequence[str] = ("bf16-mixed",), budget_s: float = 120.0,
         parity_steps: int = 6, rtol: float = 0.05, min_gain: float = 0.03,
         progress: Callable[[str, int, int], None] | None = None) -> TuneReport:  # fmt: skip
    """Search ``tunable``'s knobs for each policy (module docstring); ``progress(text, done, total)``
    is told each trial. Returns the report (``report.best``: the fastest configuration with parity)."""
    _check(budget_s, parity_steps, rtol, min_gain)
    policies = check_policies(policies)
    start = time.monotonic()
    base = defaults(tunable.knobs)
    # knob-major: every policy gets each knob's values in turn, so a short budget tunes them alike
    plan = [(p, k, v) for k, knob in tunable.knobs.items() for v in knob.values[1:] for p in policies
            if knob.policies is None or p in knob.policies]  # fmt: skip
    total = len(plan) + len(policies) + 1
    done = 0

    def tell(text: str) -> None:
        if progress is not None:
            progress(text, done, total)

    reference = Candidate.of("float32", base)
    tell(f"{reference.label}: reference losses")
    ref_step = tunable.build(reference)
    ref_losses, ref_times = _run(ref_step, parity_steps)
    setup = time.monotonic() - start  # a configuration's build and parity steps: the longest seen so far
    ref_loss = ref_losses[-1]
    if not math.isfinite(ref_loss):
        ref_step.close()
        raise PolyampError(f"the float32 reference's loss after {parity_steps} steps is {ref_loss}: nothing "
                           "to check parity against; fix the model or its learning rate first")  # fmt: skip
    trials: list[Trial] = []
    timing_budget = budget_s * (1 - FINAL_SHARE)
    # each policy's current configuration, its built step and its latest step times
    current: dict[str, tuple[Candidate, Step, list[float]]] = {"float32": (reference, ref_step, ref_times)}
    for policy in policies[1:]:  # the defaults first: every policy is checked, whatever the budget
        done += 1
        candidate = Candidate.of(policy, base)
        tell(f"{candidate.label}: parity")
        t0 = time.monotonic()
        step = tunable.build(candidate)
        trial, times = _check_parity(candidate, step, parity_steps, ref_loss, ref_times, rtol)
        setup = max(setup, time.monotonic() - t0)
        trials.append(trial)
        if trial.status == "ok":
            current[policy] = (candidate, step, times)
        else:
            step.close()
    tried = {reference} | {t.candidate for t in trials}
    work = plan
    for _ in range(MAX_PASSES):
        changed = False
        for n, (policy, knob, value) in enumerate(work):
            done += 1
            if policy not in current:  # its default broke parity, failed or was far slower
                continue
            cur, cur_step, cur_times = current[policy]
            alt = cur.with_(**{knob: value})
            if alt in tried:  # a later pass: tried already, or the value the current configuration has
                continue
            tried.add(alt)
            left = sum(1 for p, _, _ in work[n:] if p in current)
            spent = time.monotonic() - start
            if spent + setup > timing_budget:
                trials.append(Trial(alt, cur, "not tried", _spent(spent, setup)))
                continue
            tell(alt.label)
            rounds_budget = max((timing_budget - spent) / max(left, 1) - setup, 0.05)
            t0 = time.monotonic()
            trial, alt_step = _try(tunable, alt, cur, cur_step, cur_times, parity_steps, ref_loss, rtol,
                                   min_gain, rounds_budget)  # fmt: skip
            setup = max(setup, time.monotonic() - t0 - sum(trial.times) - sum(trial.base_times))
            trials.append(trial)
            if trial.status == "chosen":
                changed = True
                cur_step.close()
                current[policy] = (alt, alt_step, trial.times)
            elif alt_step is not None:
                alt_step.close()
        if not changed or time.monotonic() - start + setup > timing_budget:
            break
        work = [(p, k, v) for k, knob in tunable.knobs.items() for v in knob.values for p in policies
                if p in current and (knob.policies is None or p in knob.policies)
                and current[p][0].with_(**{k: v}) not in tried]  # fmt: skip
        total += len(work)
    tuned = {}
    for policy in policies:
        if policy in current:
            tuned[policy] = current[policy][0]
            current[policy][1].close()
    done = total - 1
    tell("side by side: default and tuned configurations")
    final = _final(tunable, policies, base, tuned, max(budget_s - (time.monotonic() - start), 0.05))
    trials += _revert_slower(final, tuned, base)
    return TuneReport(framework=tunable.framework, name=tunable.name, policies=policies, knobs=tunable.knobs,
                      trials=trials, tuned=tuned, final=final, budget_s=budget_s,
                      spent_s=time.monotonic() - start, parity_steps=parity_steps, rtol=rtol,
                      min_gain=min_gain, reference_loss=ref_loss)  # fmt: skip


def _spent(spent: float, setup: float) -> str:
    return (f"the budget was spent: {spent:.0f} s gone, and building and checking a configuration has "
            f"taken up to {setup:.0f} s")  # fmt: skip


def _run(step: Step, n: int, first: int = 0) -> tuple[list[float], list[float]]:
    """Losses and seconds of steps ``first .. first + n - 1``."""
    losses, times = [], []
    for i in range(first, first + n):
        t0 = time.perf_counter()
        losses.append(float(step.step(i)))
        times.append(time.perf_counter() - t0)
    return losses, times


def _check_parity(candidate: Candidate, step: Step, n: int, ref_loss: float, ref_times: list[float],
                  rtol: float, baseline: Candidate | None = None) -> tuple[Trial, list[float]]:  # fmt: skip
    """``candidate``'s parity steps: status ``ok`` / ``failed`` / ``parity`` / ``slower``."""
    try:
        first_loss, first_time = _run(step, 2 if n >= 2 else 1)
        typical = statistics.median(ref_times[1:] or ref_times)
        if len(first_time) == 2 and first_time[1] > max(SLOW * typical, SLOW_S):
            ratio = first_time[1] / typical
            why = (f"its second step took {first_time[1]:.3g} s, {ratio:.1f}x the configuration it would "
                   "replace; not timed further")  # fmt: skip
            return Trial(candidate, baseline, "slower", why, step_s=first_time[1]), []
        losses, times = _run(step, n - len(first_loss), len(first_loss))
    except Exception as err:  # an unsupported op, a compiler error: the candidate is listed with it
        return Trial(candidate, baseline, "failed", f"{type(err).__name__}: {err}"[:300]), []
    losses, times = first_loss + losses, first_time + times
    last = losses[-1]
    if not all(math.isfinite(v) for v in losses):
        return Trial(candidate, baseline, "failed", f"a non-finite loss in its first {n} steps: {losses}"), []
    diff = abs(last - ref_loss) / max(abs(ref_loss), 1e-12)
    trial = Trial(candidate, baseline, "ok", "", final_loss=last, parity=diff)
    if diff > rtol:
        trial.status = "parity"
        trial.reason = (f"loss after {n} steps {last:.6g} against float32's {ref_loss:.6g}: {diff:.2%} "
                        f"apart, over the {rtol:.0%} tolerance")  # fmt: skip
    return trial, times


def _try(tunable: Tunable, alt: Candidate, current: Candidate, cur_step: Step, cur_times: list[float],
         n: int, ref_loss: float, rtol: float, min_gain: float,
         budget: float) -> tuple[Trial, Step | None]:  # fmt: skip
    """Build, check and time ``alt`` against ``current`` (module docstring, step 2)."""
    try:
        alt_step = tunable.build(alt)
    except Exception as err:
        return Trial(alt, current, "failed", f"{type(err).__name__}: {err}"[:300]), None
    trial, alt_times = _check_parity(alt, alt_step, n, ref_loss, cur_times, rtol, current)
    if trial.status != "ok":
        return trial, alt_step
    times = _paired({"current": cur_step, "alternative": alt_step}, budget, first=n)
    ratio = paired_ratio(times["current"], times["alternative"], current.label, "rounds in one process")
    failed = next((t for t in times.values() if t.status != "ok"), None)
    if failed is not None or ratio is None:
        trial.status, trial.reason = "failed", (failed.error if failed else "no timed round")
        return trial, alt_step
    trial.speedup, trial.ci95, trial.rounds = ratio.speedup, ratio.ci95, ratio.rounds
    trial.step_s = statistics.median(times["alternative"].times)
    trial.base_step_s = statistics.median(times["current"].times)
    trial.times, trial.base_times = times["alternative"].times, times["current"].times
    if ratio.rounds < MIN_CHOICE_ROUNDS:
        trial.status = "no gain"
        trial.reason = (f"{ratio.speedup:.2f}x the step it would replace, over only {ratio.rounds} paired "
                        f"round(s) (the budget's share; a choice needs {MIN_CHOICE_ROUNDS})")  # fmt: skip
    elif ratio.speedup >= 1 + min_gain and ratio.ci95 is not None and ratio.ci95[0] > 1:
        lo, hi = ratio.ci95
        trial.status = "chosen"
        trial.reason = f"{ratio.speedup:.2f}x the step it replaced (95 % interval {lo:.2f}-{hi:.2f})"
    else:
        trial.status = "slower" if ratio.speedup < 1 else "no gain"
        interval = "no interval" if ratio.ci95 is None else "95 % interval {:.2f}-{:.2f}".format(*ratio.ci95)
        trial.reason = (f"{ratio.speedup:.2f}x the step it would replace ({interval}; a choice needs "
                        f"{1 + min_gain:.2f}x and an interval above 1)")  # fmt: skip
    return trial, alt_step


def _paired(steps: dict[str, Step], budget: float, first: int) -> dict[str, PolicyTimes]:
    """``run_rounds`` over built steps, their batches continuing from ``first``; the warm-up step is
    left out of a budget that the parity steps already warmed."""

    def timed(step: Step) -> Callable[[int], float]:
        def call(i: int) -> float:
            t0 = time.perf_counter()
            step.step(first + i)
            return time.perf_counter() - t0

        return call

    per_case = max(budget / max(len(steps), 1), 1e-3)
    return run_rounds({k: timed(s) for k, s in steps.items()}, MAX_ROUNDS + 1, per_case, count_warmup=False)


def _final(tunable: Tunable, policies, base: dict[str, Any], tuned: dict[str, Candidate],
           budget: float) -> list[Final]:  # fmt: skip
    """Each policy's default and tuned configurations in one set of rounds (module docstring, step 4)."""
    configs: dict[str, Candidate] = {}
    for policy in policies:
        if policy not in tuned:  # its default failed, broke parity or was far slower: not a choice
            continue
        configs[f"{policy} default"] = Candidate.of(policy, base)
        if tuned[policy] != Candidate.of(policy, base):
            configs[f"{policy} tuned"] = tuned[policy]
    steps: dict[str, Step] = {}
    failures: dict[str, str] = {}
    for key, candidate in configs.items():
        try:
            steps[key] = tunable.build(candidate)
        except Exception as err:
            failures[key] = f"{type(err).__name__}: {err}"[:300]
    try:
        times = _paired(steps, budget, first=0)
    finally:
        for step in steps.values():
            step.close()
    baseline = times.get("float32 default")
    out = []
    for key, candidate in configs.items():
        t = times.get(key)
        ratio = None
        if t is not None and baseline is not None and key != "float32 default" and t.status == "ok":
            ratio = paired_ratio(baseline, t, "float32 default", "rounds in one process")
        out.append(Final(key, candidate, statistics.median(t.times) if t is not None and t.times else None,
                         None if ratio is None else ratio.speedup, None if ratio is None else ratio.ci95,
                         failures.get(key) or (t.error if t is not None and t.status != "ok" else None),
                         t.times if t is not None else []))  # fmt: skip
    return out


def _revert_slower(final: list[Final], tuned: dict[str, Candidate], base: dict[str, Any]) -> list[Trial]:
    """Each policy whose tuned configuration the final rounds find slower than its default (module
    docstring, step 4): ``tuned`` set back to the default, and a ``reverted`` trial saying why."""
    by_key = {f.key: f for f in final if f.error is None and f.times}
    out = []
    for policy in list(tuned):
        default, mine = by_key.get(f"{policy} default"), by_key.get(f"{policy} tuned")
        if default is None or mine is None:
            continue
        ratio = paired_ratio(PolicyTimes(times=default.times), PolicyTimes(times=mine.times), "default",
                             "rounds in one process")  # fmt: skip
        if ratio is None or ratio.ci95 is None or ratio.ci95[1] >= 1:
            continue
        lo, hi = ratio.ci95
        out.append(Trial(tuned[policy], Candidate.of(policy, base), "reverted",
                         f"in the final rounds it ran {ratio.speedup:.2f}x its policy's default (95 % "
                         f"interval {lo:.2f}-{hi:.2f}, {ratio.rounds} rounds): the default is kept",
                         speedup=ratio.speedup, ci95=ratio.ci95, rounds=ratio.rounds))  # fmt: skip
        tuned[policy] = Candidate.of(policy, base)
    return out


def _check(budget_s, parity_steps, rtol, min_gain) -> None:
    for name, value, low in (("budget_s", budget_s, 0.0), ("rtol", rtol, 0.0), ("min_gain", min_gain, -1.0)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not value > low or math.isinf(value):
            raise PolyampError(f"tune's {name} must be a finite number > {low:g}; received {value!r}")
    if isinstance(parity_steps, bool) or not isinstance(parity_steps, int) or parity_steps < 2:
        raise PolyampError(f"tune's parity_steps must be an integer >= 2; received {parity_steps!r}")
