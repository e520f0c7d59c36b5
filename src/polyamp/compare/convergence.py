"""What ``--converge`` found: per-case summaries over seeds, the parity test, and its outputs.

``summarize`` turns runs (``converge.Run``) into one :class:`Summary` per (framework, workload,
policy), over the runs that finished (a capped, failed or unsupported run does not count), and
decides each mixed policy's :class:`Parity` against float32 of the same framework and workload by
the test in ``TEST``. ``write`` puts convergence.json, convergence.md and convergence.png in a
folder. matplotlib is imported only when the figure is drawn.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .converge import OK, Plan, Run
from .workloads import get_workload

BASELINE = "float32"
TEST = (
    "A mixed policy is at parity with float32 of the same framework and workload when, over the seeds "
    "whose runs finished (capped, failed or unsupported runs do not count): (1) gap <= max(2 sd, "
    "tolerance), where gap = how much worse the mixed policy's mean final metric is than float32's "
    "(accuracy: the absolute drop; loss: the increase relative to float32's mean), sd = the sample "
    "standard deviation of float32's final metric over its seeds in the same units (0 with one seed), "
    "tolerance = the workload's (digits 0.02 accuracy, charlm 5 %); and (2) the share of seeds that "
    "reached the target is at least float32's. A mixed policy doing better than float32 has a negative "
    "gap and passes (1)."
)
_SLACK = 1e-9  # a gap equal to its allowance passes despite floating-point rounding


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation of ``n`` values (``sd`` None with fewer than two)."""

    n: int
    mean: float | None
    sd: float | None

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        values = [v for v in values if v is not None]
        return cls(len(values), statistics.fmean(values) if values else None,
                   statistics.stdev(values) if len(values) > 1 else None)  # fmt: skip

    def text(self, digits: int = 3) -> str:
        if self.mean is None:
            return "-"
        spread = f" ± {self.sd:.{digits}g}" if self.sd is not None else ""
        return f"{self.mean:.{digits}g}{spread}"


@dataclass(frozen=True)
class Parity:
    """A mixed policy against float32: ``verdict`` parity, behind, fewer reached, or n/a."""

    verdict: str
    gap: float | None = None
    allowed: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Summary:
    """One (framework, workload, policy) over its seeds."""

    framework: str
    workload: str
    policy: str
    metric: str
    higher_is_better: bool
    target: float
    seeds: int
    finished: int
    reached: int
    capped: int
    crashed: int
    steps_to_target: Stat
    final_metric: Stat
    skipped_steps: int
    wall_s: float
    statuses: dict[str, int]
    parity: Parity | None = None  # None for float32, the baseline
    notes: list[str] = field(default_factory=list)

    @property
    def case_names(self) -> list[str]:
        return [self.framework, self.workload, self.policy]


def summarize(runs: list[Run]) -> list[Summary]:
    """One summary per case, in the order the runs come, each mixed one with its parity."""
    cases: dict = {}
    for run in runs:
        cases.setdefault(run.case, []).append(run)
    rows = {case: _summary(case, group) for case, group in cases.items()}
    out = []
    for (framework, workload, policy), row in rows.items():
        if policy != BASELINE:
            baseline = rows.get((framework, workload, BASELINE))
            row = _with_parity(row, baseline)
        out.append(row)
    return out


def _summary(case: tuple[str, str, str], runs: list[Run]) -> Summary:
    wl = get_workload(case[1], quick=True)
    done = [r for r in runs if r.status == OK]
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    notes = sorted({f"{r.status}: {r.cap_reason or r.error}" for r in runs if r.status != OK})
    return Summary(
        *case, metric=wl.metric_name, higher_is_better=wl.higher_is_better, target=wl.target.value,
        seeds=len(runs), finished=len(done), reached=sum(r.steps_to_target is not None for r in done),
        capped=statuses.get("capped", 0), crashed=statuses.get("failed", 0) + statuses.get("timeout", 0),
        steps_to_target=Stat.of([r.steps_to_target for r in done]),
        final_metric=Stat.of([r.final_metric for r in done]),
        skipped_steps=sum(r.skipped_steps for r in done), wall_s=sum(r.wall_s for r in runs),
        statuses=statuses, notes=notes,
    )  # fmt: skip


def parity(mixed: Summary, baseline: Summary | None) -> Parity:
    """The test in ``TEST`` for ``mixed`` against ``baseline`` (float32, same framework and workload)."""
    if baseline is None or baseline.finished == 0 or baseline.final_metric.mean is None:
        return Parity("n/a", reason="no finished float32 run to compare with")
    if mixed.finished == 0 or mixed.final_metric.mean is None:
        return Parity("n/a", reason=f"no finished {mixed.policy} run")
    wl = get_workload(mixed.workload, quick=True)
    base = baseline.final_metric
    sd = abs(wl.gap(base.mean + (base.sd or 0.0), base.mean))  # float32's sd in gap units
    allowed = max(2 * sd, wl.tolerance)
    gap = wl.gap(mixed.final_metric.mean, base.mean)
    behind = gap > allowed + _SLACK
    fewer = mixed.reached / mixed.finished < baseline.reached / baseline.finished
    verdict = ", ".join(v for v, bad in (("behind", behind), ("fewer reached", fewer)) if bad) or "parity"
    reached = f"reached {mixed.reached}/{mixed.finished} vs float32 {baseline.reached}/{baseline.finished}"
    reasons = [f"gap {gap:+.3g} {'>' if behind else '<='} allowed {allowed:.3g}", reached]
    if base.sd is None:
        reasons.append("one float32 seed: tolerance only")
    if mixed.finished < mixed.seeds or baseline.finished < baseline.seeds:
        reasons.append(f"on {mixed.finished} of {mixed.seeds} seeds vs float32's {baseline.finished} "
                       f"of {baseline.seeds}")  # fmt: skip
    return Parity(verdict, gap, allowed, "; ".join(reasons))


def _with_parity(row: Summary, baseline: Summary | None) -> Summary:
    return replace(row, parity=parity(row, baseline))


# -- outputs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """How the convergence run was made, for convergence.json and .md."""

    plan: Plan
    every: dict[str, int]
    steps: dict[str, int]
    jobs: int
    threads_per_job: int
    date: str
    command: str | None
    machine: dict
    wall_s: float


def to_json(settings: Settings, runs: list[Run], summaries: list[Summary]) -> dict:
    return {"settings": asdict(settings), "test": TEST, "runs": [asdict(r) for r in runs],
            "summary": [asdict(s) for s in summaries]}  # fmt: skip


def _cell_parity(s: Summary) -> str:
    if s.parity is None:
        return "baseline"
    p = s.parity
    if p.gap is None:
        return f"{p.verdict}: {p.reason}"
    return f"{p.verdict} (gap {p.gap:+.3g}, allowed {p.allowed:.3g})"


HEADERS = ["framework", "workload", "policy", "finished", "reached", "steps to target", "final metric",
           "skipped", "parity vs float32", "not counted"]  # fmt: skip


def table_rows(summaries: list[Summary]) -> list[list[str]]:
    rows = []
    for s in summaries:
        missing = ", ".join(f"{n} {status}" for status, n in s.statuses.items() if status != OK) or "-"
        metric = f"{s.metric} {s.final_metric.text()}" if s.final_metric.mean is not None else "-"
        counts = [f"{s.finished} of {s.seeds}", str(s.reached), s.steps_to_target.text(), metric]
        rows.append([*s.case_names, *counts, str(s.skipped_steps), _cell_parity(s), missing])
    return rows


def terminal_table(summaries: list[Summary]) -> str:
    rows = [HEADERS, *table_rows(summaries)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def markdown(settings: Settings, runs: list[Run], summaries: list[Summary], figure: str | None) -> str:
    plan = settings.plan
    targets = ", ".join(f"{w}: {get_workload(w, quick=True).metric_name} "
                        f"{'>=' if get_workload(w, quick=True).higher_is_better else '<='} "
                        f"{get_workload(w, quick=True).target.value:g} within {settings.steps[w]} steps, "
                        f"evaluated every {settings.every[w]}" for w in plan.workloads)  # fmt: skip
    lines = [
        "# Convergence over seeds (`polyamp compare --converge`)", "",
        f"- Command: `{settings.command or 'polyamp compare --converge'}`; {settings.date}",
        f"- {_seeds(plan.seeds)} (each draws the weights, the data order and digits' split); "
        f"{'quick sizes (a smoke check, not a finding)' if plan.quick else 'full-size workloads'}; {targets}",
        f"- Budget {plan.budget_s:g} s per run; {settings.jobs} runs side by side, "
        f"{settings.threads_per_job} thread(s) each; wall time {settings.wall_s:.0f} s "
        f"({settings.wall_s / 60:.1f} min) on {settings.machine.get('cpu')} "
        f"({settings.machine.get('cores')} cores)",
        "", "## The parity test", "", TEST, "",
        "## Results", "",
        "`finished`: runs that trained all their steps, of the seeds run; `reached`: of those, how many "
        "reached the target. Steps to target and final metric: mean ± sd over the finished runs (steps: "
        "over those that reached). `skipped`: optimizer steps skipped for non-finite gradients. `not "
        "counted`: runs capped by the budget, unsupported or crashed (listed below).", "",
        "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS),
        *("| " + " | ".join(row) + " |" for row in table_rows(summaries)),
    ]  # fmt: skip
    if figure:
        lines += ["", f"![held-out metric vs step, mean ± 1 sd over seeds]({figure})"]
    others: dict = {}  # (case, status, why) -> seeds
    for r in runs:
        if r.status != OK:
            others.setdefault((r.case, r.status, r.cap_reason or r.error), []).append(str(r.seed))
    if others:
        lines += ["", "## Runs not counted", ""]
        lines += [f"- {' '.join(case)}, seed{'s' * (len(seeds) > 1)} {', '.join(seeds)}: {status}: {why}"
                  for (case, status, why), seeds in others.items()]  # fmt: skip
    lines += ["", "## Parity details", ""]
    lines += [f"- {s.framework} {s.workload} {s.policy}: {s.parity.verdict}: {s.parity.reason}"
              for s in summaries if s.parity is not None]  # fmt: skip
    return "\n".join(lines) + "\n"


# float32 wide underneath, so that a mixed policy on the same curve still shows both
_STYLE = {"float32": dict(color="#999999", linewidth=3.2), "bf16-mixed": dict(color="#1f77b4", linewidth=1.6),
          "fp16-mixed": dict(color="#d62728", linewidth=1.2, dashes=(4, 2))}  # fmt: skip


def figure(plan: Plan, runs: list[Run]):
    """Per workload (rows) and framework (columns): the held-out metric against the step, per policy
    a mean line with a ±1 sd band over the finished seeds (capped runs: a dotted mean), the target
    dashed."""
    from matplotlib.figure import Figure

    rows, cols = len(plan.workloads), len(plan.frameworks)
    fig = Figure(figsize=(max(3.6 * cols + 0.6, 5.0), 2.9 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, workload in enumerate(plan.workloads):
        wl = get_workload(workload, quick=True)
        for j, framework in enumerate(plan.frameworks):
            ax = axes[i][j]
            ax.set_title(f"{framework} · {workload}", fontsize=9)
            ax.axhline(wl.target.value, color="grey", linestyle="--", linewidth=1, label="target")
            for policy in plan.policies:
                group = [r for r in runs if r.case == (framework, workload, policy)]
                _draw(ax, policy, group)
            if i == rows - 1:
                ax.set_xlabel("step")
            if j == 0:
                ax.set_ylabel(wl.metric_name)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
            missing = [f"{p}: {', '.join(sorted({r.status for r in group}))}"
                       for p in plan.policies
                       if (group := [r for r in runs if r.case == (framework, workload, p)])
                       and not any(r.status == OK for r in group)]  # fmt: skip
            if missing:
                y, va = (0.03, "bottom") if wl.higher_is_better else (0.97, "top")  # away from the curves
                ax.text(0.97, y, "no finished run:\n" + "\n".join(missing), transform=ax.transAxes,
                        fontsize=7, ha="right", va=va, color="#555555")  # fmt: skip
        handles, labels = axes[i][0].get_legend_handles_labels()
        for ax in axes[i]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        axes[i][-1].legend(handles, labels, fontsize=7, loc="best")
    fig.suptitle(f"Held-out metric vs step, mean ± 1 sd over {_seeds(plan.seeds)}", fontsize=10)
    return fig


def _seeds(n: int) -> str:
    return "1 seed (0)" if n == 1 else f"{n} seeds (0-{n - 1})"


def _draw(ax, policy: str, runs: list[Run]) -> None:
    import numpy as np

    finished = [r for r in runs if r.status == OK]
    use = finished or [r for r in runs if r.status == "capped" and len(r.curve) > 1]
    if not use:
        return
    steps = sorted(set.intersection(*({s for s, v in r.curve if v is not None} for r in use)))
    if not steps:
        return
    values = np.array([[dict(r.curve)[s] for s in steps] for r in use], dtype=float)
    mean = values.mean(0)
    style = dict(_STYLE.get(policy, {"linewidth": 1.2}))
    if not finished:
        style["dashes"] = (1, 2)
    lines = ax.plot(steps, mean, label=policy if finished else f"{policy} (capped)", **style)
    if len(use) > 1:
        sd = values.std(0, ddof=1)
        ax.fill_between(steps, mean - sd, mean + sd, color=lines[0].get_color(), alpha=0.15, linewidth=0)


def write(settings: Settings, runs: list[Run], summaries: list[Summary], out_dir: str | Path) -> dict:
    """convergence.json, .md and .png in ``out_dir``; returns their paths by kind."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"convergence.{ext}" for kind, ext in (("json", "json"), ("markdown", "md"),
                                                                 ("figure", "png"))}  # fmt: skip
    fig = figure(settings.plan, runs)
    FigureCanvasAgg(fig).print_png(str(paths["figure"]))
    paths["json"].write_text(json.dumps(_finite(to_json(settings, runs, summaries)), indent=1) + "\n")
    paths["markdown"].write_text(markdown(settings, runs, summaries, paths["figure"].name), encoding="utf-8")
    return paths


def _finite(obj):
    """``obj`` with non-finite floats as None (JSON has no inf or NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
