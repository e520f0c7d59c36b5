"""The search: per policy, one knob at a time, each alternative checked for loss parity and then timed in
paired rounds against the configuration it would replace.

1. The float32 default is the reference: ``parity_steps`` steps from the shared initial weights give the
   reference loss ``L32`` (the last step's).
2. Each low-precision policy's default configuration is checked for parity first (a policy that
   fails is dropped with its reason). Then, knob by knob and value by value, for each policy in turn
   (so that a short budget tunes them alike; knobs with a ``build_s``, whose first build is long, after
   the others), the alternative to the policy's current configuration:
   build it and step it ``parity_steps`` times (its first step also compiles and warms up). It fails
   if a step raises or a loss is not finite, breaks parity if its last loss differs from ``L32`` by
   more than ``rtol * |L32|``, and is *slower* without further timing when its second step takes
   over ``SLOW`` times the current one's. Otherwise both step on in rounds that alternate their order
   (``timing.run_rounds``), and the alternative replaces the current configuration when the
   median of the per-round ratios (over at least ``MIN_CHOICE_ROUNDS`` rounds) is at least
   ``1 + min_gain`` and its 95 % bootstrap interval lies above 1 (one round has no interval: None).
   Every alternative is reported, whatever happened to it. Knobs interact (on a CPU,
   ``torch.compile`` gains little around flash attention and much around the math kernel), so while a
   pass has chosen something, another pass tries every knob value (defaults included) whose
   configuration with the current ones has not been tried yet, up to ``MAX_PASSES`` passes.
3. The budget (seconds of wall time) holds everything, the float32 reference's build and parity steps
   included. Each configuration's build (with its first step: compilation, warm-up) and typical step
   are measured as it runs (``_Costs``); one not built yet is estimated by the build and the step of
   the configuration it would replace, and a knob value no build has had yet adds its knob's
   ``build_s`` (a first ``torch.compile``). The final rounds keep FINAL_SHARE of the budget, but at
   least what MIN_CHOICE_ROUNDS of them cost and at most what MAX_ROUNDS cost. The reference and each
   policy's default are checked whatever the budget (the least a report says; a note says when they
   alone took more). A knob value is tried only when its estimate (a build, the parity steps, a
   warm-up round and MIN_CHOICE_ROUNDS paired rounds) and the final rounds still fit; a try's rounds
   are its equal share of what is left, within [MIN_CHOICE_ROUNDS, MAX_ROUNDS], and the final rounds
   as many as the time left allows, in the same bounds. What does not fit is listed as not tried with
   the budget that would have tried it; when no knob value could be tried, the report's notes say so,
   and what budget would try the first. A build longer than its estimate can still run the budget
   over by the difference: a note says so.
4. Finally every policy's default and tuned configurations (of the policies whose default kept
   parity) are stepped side by side in one set of rounds, on the steps the search built (kept open
   for them: no rebuild, no second compile): each one's paired speed-up over the float32
   default, and the best tuned low-precision step over the best tuned float32 step, from the same
   rounds. A tuned configuration that these rounds find slower than its policy's default (the 95 %
   interval of default seconds / tuned seconds entirely below 1: choices that held in their own rounds
   but not together) is reverted to the default, and listed as a ``reverted`` trial with the figures.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import PolyampError
from ..timing import PolicyTimes, paired_ratio, run_rounds
from .report import Final, Trial, TuneReport, seconds
from .space import Candidate, Knob, Step, Tunable, check_policies, defaults

SLOW = 3.0  # an alternative whose second step takes this many times the current one's, and at least
SLOW_S = 1.0  # this many seconds, is slower without further timing (fp16 where a CPU has no fp16 units)
MAX_ROUNDS = 15
MIN_CHOICE_ROUNDS = 3  # paired rounds a choice, and the final rounds' figures, rest on at least
MAX_PASSES = 3  # over the knobs, while the previous pass chose something
FINAL_SHARE = 0.25  # of the budget kept for the final rounds (at least what MIN_CHOICE_ROUNDS of them cost)
ROUNDS_MARGIN = 1.25  # a timed step may run this much over its estimate before its rounds are cut short


class _Costs:
    """Seconds measured per configuration: its build with its first step (compile, warm-up), and a
    typical step after it. A configuration not built yet is estimated by the build and the step of the
    configuration it would replace, plus the ``build_s`` of each of its knob values no measured build
    had (a first compile)."""

    def __init__(self, knobs: Mapping[str, Knob]) -> None:
        self.knobs = knobs
        self.build: dict[Candidate, float] = {}
        self.step: dict[Candidate, float] = {}

    def note(self, candidate: Candidate, total_s: float, times: Sequence[float]) -> None:
        """``total_s``: the build and the steps ``times`` (its parity steps) together."""
        if not times:
            return
        step = statistics.median(times[1:] or times)
        self.step[candidate] = step
        self.build[candidate] = max(total_s - step * (len(times) - 1), step)

    def build_of(self, candidate: Candidate, like: Candidate) -> float:
        if candidate in self.build:
            return self.build[candidate]
        seen = {kv for c in self.build for kv in c.settings}
        extra = sum(self.knobs[k].build_s for k, v in candidate.settings
                    if k in self.knobs and v != self.knobs[k].default and (k, v) not in seen)  # fmt: skip
        return self.build.get(like, max(self.build.values(), default=0.0)) + extra

    def step_of(self, candidate: Candidate, like: Candidate) -> float:
        return self.step.get(candidate, self.step.get(like, 0.0))

    def try_s(self, alt: Candidate, current: Candidate, parity_steps: int, rounds: int) -> float:
        """A try: ``alt``'s build, its parity steps, a warm-up round and ``rounds`` paired rounds."""
        cur, new = self.step_of(current, current), self.step_of(alt, current)
        return self.build_of(alt, current) + (parity_steps - 1) * new + (rounds + 1) * (cur + new)

    def final_s(self, configs: Sequence[Candidate], rounds: int) -> float:
        """The final rounds over the configurations' built steps: a warm-up round, then ``rounds``."""
        return (rounds + 1) * sum(self.step_of(c, configs[0]) for c in configs)

    def final_rounds(self, configs: Sequence[Candidate], seconds: float) -> int:
        """The rounds that fit in ``seconds``, within [MIN_CHOICE_ROUNDS, MAX_ROUNDS]."""
        per_round = self.final_s(configs, 0)
        fit = seconds / per_round - 1 if per_round > 0 else MAX_ROUNDS
        return int(min(max(fit, MIN_CHOICE_ROUNDS), MAX_ROUNDS))


def tune(tunable: Tunable, policies: Sequence[str] = ("bf16-mixed",), budget_s: float = 120.0,
         parity_steps: int = 6, rtol: float = 0.05, min_gain: float = 0.03,
         progress: Callable[[str, int, int], None] | None = None) -> TuneReport:  # fmt: skip
    """Search ``tunable``'s knobs for each policy (module docstring); ``progress(text, done, total)``
    is told each trial. Returns the report (``report.best``: the fastest configuration with parity)."""
    _check(budget_s, parity_steps, rtol, min_gain)
    policies = check_policies(policies)
    start = time.monotonic()
    base = defaults(tunable.knobs)
    # knob-major: every policy gets each knob's values in turn, so a short budget tunes them alike; the
    # knobs whose first build is long (compile) last, so that a short budget tries the others first
    order = sorted(tunable.knobs.items(), key=lambda kv: kv[1].build_s > 0)
    plan = [(p, k, v) for k, knob in order for v in knob.values[1:] for p in policies
            if knob.policies is None or p in knob.policies]  # fmt: skip
    total = len(plan) + len(policies) + 1
    done = 0

    def tell(text: str) -> None:
        if progress is not None:
            progress(text, done, total)

    def elapsed() -> float:
        return time.monotonic() - start

    reference = Candidate.of("float32", base)
    tell(f"{reference.label}: reference losses")
    ref_step = tunable.build(reference)
    ref_losses, ref_times = _run(ref_step, parity_steps)
    costs = _Costs(tunable.knobs)
    costs.note(reference, elapsed(), ref_times)
    ref_loss = ref_losses[-1]
    if not math.isfinite(ref_loss):
        ref_step.close()
        raise PolyampError(f"the float32 reference's loss after {parity_steps} steps is {ref_loss}: nothing "
                           "to check parity against; fix the model or its learning rate first")  # fmt: skip
    trials: list[Trial] = []
    budget = _Budget(budget_s, costs, reference)
    # each policy's current configuration, its built step and its latest step times; its default's step,
    # kept for the final rounds
    current: dict[str, tuple[Candidate, Step, list[float]]] = {"float32": (reference, ref_step, ref_times)}
    kept: dict[str, Step] = {"float32": ref_step}
    for policy in policies[1:]:  # the defaults first: every policy is checked, whatever the budget
        done += 1
        candidate = Candidate.of(policy, base)
        tell(f"{candidate.label}: parity")
        t0 = time.monotonic()
        try:
            step = tunable.build(candidate)
        except Exception as err:  # a policy the framework refuses here (MXNet bf16 without AVX-512)
            trials.append(Trial(candidate, None, "failed", f"{type(err).__name__}: {err}"[:300]))
            continue
        trial, times = _check_parity(candidate, step, parity_steps, ref_loss, ref_times, rtol)
        costs.note(candidate, time.monotonic() - t0, times)
        trials.append(trial)
        if trial.status == "ok":
            current[policy] = (candidate, step, times)
            kept[policy] = step
        else:
            step.close()
    budget.checked_s = elapsed()
    tried = {reference} | {t.candidate for t in trials}
    work = plan
    for _ in range(MAX_PASSES):
        changed = False
        for n, (policy, knob, value) in enumerate(work):
            done += 1
            if policy not in current:  # its default broke parity, failed, was far slower or not tried
                continue
            cur, cur_step, cur_times = current[policy]
            alt = cur.with_(**{knob: value})
            if alt in tried:  # a later pass: tried already, or the value the current configuration has
                continue
            tried.add(alt)
            finals = _configs(policies, base, {p: c for p, (c, _, _) in current.items()} | {policy: alt})
            reserve = budget.final_reserve(finals)
            need = costs.try_s(alt, cur, parity_steps, MIN_CHOICE_ROUNDS)
            if elapsed() + need + reserve > budget_s:
                what = (f"its try (a build, {parity_steps} parity steps, {MIN_CHOICE_ROUNDS} paired rounds) "
                        f"with the final rounds ({seconds(reserve)} s)")  # fmt: skip
                trials.append(Trial(alt, cur, "not tried", budget.short(elapsed(), need + reserve, what)))
                continue
            tell(alt.label)
            left = sum(1 for p, _, _ in work[n:] if p in current)
            share = (budget_s - elapsed() - reserve) / max(left, 1)
            rounds = _rounds(share - costs.try_s(alt, cur, parity_steps, 0), costs.step_of(cur, cur) * 2)
            trial, alt_step, alt_times, setup_s = _try(tunable, alt, cur, cur_step, cur_times, parity_steps,
                                                       ref_loss, rtol, min_gain, rounds)  # fmt: skip
            costs.note(alt, setup_s, alt_times)
            trials.append(trial)
            if trial.status == "chosen":
                changed = True
                if cur_step is not kept[policy]:
                    cur_step.close()
                current[policy] = (alt, alt_step, trial.times)
            elif alt_step is not None:
                alt_step.close()
        if not changed:
            break
        work = [(p, k, v) for k, knob in order for v in knob.values for p in policies
                if p in current and (knob.policies is None or p in knob.policies)
                and current[p][0].with_(**{k: v}) not in tried]  # fmt: skip
        total += len(work)
    tuned = {policy: current[policy][0] for policy in policies if policy in current}
    steps = {f"{p} default": kept[p] for p in tuned} | {f"{p} tuned": current[p][1] for p in tuned
                                                         if current[p][1] is not kept[p]}  # fmt: skip
    done = total - 1
    tell("side by side: default and tuned configurations")
    configs = _configs(policies, base, tuned)
    try:
        if len(configs) == 1:  # float32's default alone: nothing to pair it with; its parity steps' time
            final = [Final("float32 default", reference, statistics.median(ref_times[1:]), None, None, None,
                           ref_times[1:])]  # fmt: skip
        else:
            rounds = costs.final_rounds(list(configs.values()), budget_s - elapsed())
            final = _final(configs, {k: steps[k] for k in configs}, rounds, costs)
    finally:
        for step in steps.values():
            step.close()
    trials += _revert_slower(final, tuned, base)
    spent = elapsed()
    return TuneReport(framework=tunable.framework, name=tunable.name, policies=policies, knobs=tunable.knobs,
                      trials=trials, tuned=tuned, final=final, budget_s=budget_s, spent_s=spent,
                      parity_steps=parity_steps, rtol=rtol, min_gain=min_gain, reference_loss=ref_loss,
                      notes=budget.notes(trials, spent, configs))  # fmt: skip


class _Budget:
    """What the budget still allows (module docstring, step 3), and the notes on what it did not."""

    def __init__(self, budget_s: float, costs: _Costs, reference: Candidate):
        self.budget_s, self.costs, self.reference = budget_s, costs, reference
        self.needs: list[float] = []  # per knob value not tried, the budget that would have tried it
        self.checked_s = 0.0  # seconds to the end of the policy defaults' checks

    def final_reserve(self, configs: dict[str, Candidate]) -> float:
        """FINAL_SHARE of the budget, but at least MIN_CHOICE_ROUNDS final rounds and at most MAX_ROUNDS
        (none for float32's default alone)."""
        c = list(configs.values())
        if len(c) < 2:
            return 0.0
        least, most = self.costs.final_s(c, MIN_CHOICE_ROUNDS), self.costs.final_s(c, MAX_ROUNDS)
        return min(max(FINAL_SHARE * self.budget_s, least), most)

    def short(self, spent: float, need: float, what: str) -> str:
        """The reason a configuration was not tried, with the budget that would have tried it."""
        fits = spent + need
        self.needs.append(fits)
        return (f"the budget did not allow it: {seconds(spent)} s of {seconds(self.budget_s)} s gone, and "
                f"{what} takes about {seconds(need)} s more; a budget of about {seconds(fits, up=True)} s "
                "would")  # fmt: skip

    def notes(self, trials: list[Trial], spent: float, configs: dict[str, Candidate]) -> list[str]:
        """What the budget did not allow, and what would (module docstring, step 3)."""
        out, ref = [], self.reference
        least = self.checked_s + (self.costs.final_s(list(configs.values()), MIN_CHOICE_ROUNDS)
                                  if len(configs) > 1 else 0.0)  # fmt: skip
        tried = [t for t in trials if t.baseline is not None and t.status not in ("not tried", "reverted")]
        if self.needs and not tried:
            out.append(f"the {seconds(self.budget_s)} s budget was too small for even one paired round of a "
                       f"knob (the float32 reference took {seconds(self.costs.build[ref])} s to build and "
                       f"take its first step, {seconds(self.costs.step[ref])} s a step after): a budget of "
                       f"about {seconds(self.needs[0], up=True)} s would try the first knob "
                       "value")  # fmt: skip
        if least > self.budget_s:
            out.append(f"what every report has, float32's reference and each policy's default checked and "
                       f"timed in {MIN_CHOICE_ROUNDS} final rounds, took about {seconds(least)} s: more than "
                       f"the budget")  # fmt: skip
        elif spent > self.budget_s * 1.1:
            out.append(f"the budget ran over by {seconds(spent - self.budget_s)} s: a build or a step took "
                       "longer than the ones measured before it (a first torch.compile, say)")  # fmt: skip
        return out


def _configs(policies, base: dict[str, Any], tuned: dict[str, Candidate]) -> dict[str, Candidate]:
    """The final rounds' configurations: each checked policy's default, and its tuned one where it differs."""
    out = {}
    for policy in policies:
        if policy not in tuned:  # its default failed, broke parity, was far slower or was not tried
            continue
        out[f"{policy} default"] = Candidate.of(policy, base)
        if tuned[policy] != Candidate.of(policy, base):
            out[f"{policy} tuned"] = tuned[policy]
    return out


def _rounds(seconds: float, per_round: float) -> int:
    """The paired rounds that fit in ``seconds``, within [MIN_CHOICE_ROUNDS, MAX_ROUNDS]."""
    fit = seconds / per_round if per_round > 0 else MAX_ROUNDS
    return int(min(max(fit, MIN_CHOICE_ROUNDS), MAX_ROUNDS))


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
         rounds: int) -> tuple[Trial, Step | None, list[float], float]:  # fmt: skip
    """Build, check and time ``alt`` against ``current`` in ``rounds`` paired rounds (module docstring,
    step 2); also ``alt``'s parity step times and the seconds of its build and parity steps."""
    t0 = time.monotonic()
    try:
        alt_step = tunable.build(alt)
    except Exception as err:
        return Trial(alt, current, "failed", f"{type(err).__name__}: {err}"[:300]), None, [], 0.0
    trial, alt_times = _check_parity(alt, alt_step, n, ref_loss, cur_times, rtol, current)
    setup_s = time.monotonic() - t0
    if trial.status != "ok":
        return trial, alt_step, alt_times, setup_s
    typical = max(statistics.median(t[1:] or t) for t in (cur_times, alt_times))
    times = _paired({"current": cur_step, "alternative": alt_step}, rounds, typical, first=n)
    ratio = paired_ratio(times["current"], times["alternative"], current.label, "rounds in one process")
    failed = next((t for t in times.values() if t.status != "ok"), None)
    if failed is not None or ratio is None:
        trial.status, trial.reason = "failed", (failed.error if failed else "no timed round")
        return trial, alt_step, alt_times, setup_s
    trial.speedup, trial.ci95, trial.rounds = ratio.speedup, _interval(ratio), ratio.rounds
    trial.step_s = statistics.median(times["alternative"].times)
    trial.base_step_s = statistics.median(times["current"].times)
    trial.times, trial.base_times = times["alternative"].times, times["current"].times
    if ratio.rounds < MIN_CHOICE_ROUNDS:
        trial.status = "no gain"
        trial.reason = (f"{ratio.speedup:.2f}x the step it would replace, over only {ratio.rounds} paired "
                        f"round(s) (its steps ran over their estimate; a choice needs "
                        f"{MIN_CHOICE_ROUNDS})")  # fmt: skip
    elif ratio.speedup >= 1 + min_gain and ratio.ci95[0] > 1:
        lo, hi = ratio.ci95
        trial.status = "chosen"
        trial.reason = f"{ratio.speedup:.2f}x the step it replaced (95 % interval {lo:.2f}-{hi:.2f})"
    else:
        trial.status = "slower" if ratio.speedup < 1 else "no gain"
        interval = "95 % interval {:.2f}-{:.2f}".format(*ratio.ci95)
        trial.reason = (f"{ratio.speedup:.2f}x the step it would replace ({interval}; a choice needs "
                        f"{1 + min_gain:.2f}x and an interval above 1)")  # fmt: skip
    return trial, alt_step, alt_times, setup_s


def _interval(ratio) -> tuple[float, float] | None:
    """A paired ratio's 95 % interval, None from a single round (one sample has no spread to show)."""
    return ratio.ci95 if ratio.rounds >= 2 else None


def _paired(steps: dict[str, Step], rounds: int, typical: float, first: int) -> dict[str, PolicyTimes]:
    """``rounds`` paired rounds (``run_rounds``; its warm-up step is not counted) over built steps, their
    batches continuing from ``first``; a step whose seconds run past ROUNDS_MARGIN times ``rounds``
    ``typical`` steps leaves early (after MIN_CHOICE_ROUNDS rounds, or 3 such budgets)."""

    def timed(step: Step) -> Callable[[int], float]:
        def call(i: int) -> float:
            t0 = time.perf_counter()
            step.step(first + i)
            return time.perf_counter() - t0

        return call

    cap = max(ROUNDS_MARGIN * rounds * typical, 1e-3)
    return run_rounds({k: timed(s) for k, s in steps.items()}, rounds + 1, cap, count_warmup=False,
                      min_rounds=MIN_CHOICE_ROUNDS)  # fmt: skip


def _final(configs: dict[str, Candidate], steps: dict[str, Step], rounds: int, costs: _Costs) -> list[Final]:
    """Each policy's default and tuned configurations, their steps as the search built them, in
    ``rounds`` rounds together (module docstring, step 4)."""
    ref = next(iter(configs.values()))
    typical = max(costs.step_of(c, ref) for c in configs.values())
    times = _paired(steps, rounds, typical, first=0)
    baseline = times["float32 default"]
    out = []
    for key, candidate in configs.items():
        t = times[key]
        ratio = None
        if baseline.status == "ok" and key != "float32 default" and t.status == "ok":
            ratio = paired_ratio(baseline, t, "float32 default", "rounds in one process")
        step_s = statistics.median(t.times) if t.times else None
        error = t.error if t.status != "ok" else None
        if ratio is None:
            out.append(Final(key, candidate, step_s, None, None, error, t.times))
        else:
            out.append(Final(key, candidate, step_s, ratio.speedup, _interval(ratio), error, t.times,
                             ratio.rounds))  # fmt: skip
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
        if ratio is None or ratio.rounds < 2 or ratio.ci95[1] >= 1:
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
            what = "budget (seconds)" if name == "budget_s" else name
            raise PolyampError(f"tune's {what} must be a finite number > {low:g}; received {value!r}")
    if isinstance(parity_steps, bool) or not isinstance(parity_steps, int) or parity_steps < 2:
        raise PolyampError(f"tune's parity_steps must be an integer >= 2; received {parity_steps!r}")
