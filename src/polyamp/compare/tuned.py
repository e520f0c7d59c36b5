"""``polyamp compare --tuned``: every framework's tuned float32 and bf16 steps, side by side in one run.

For each workload, each framework that ``polyamp tune`` is built for gives two rows, its tuned float32
and its tuned bf16-mixed configuration, read from ``FOLDER/<framework>-<workload>.json`` (a saved
:class:`~polyamp.tune.TuneReport`), or made there first by ``polyamp tune`` in a child process. Under
glibc every row comes twice more, its process started in glibc malloc's heap mode
(``polyamp/tune/allocator.py``: large blocks reused from the heap instead of mapped afresh every
step), a process setting that tune's in-process search cannot time fairly; each such row is also
paired with its twin as the process starts (*vs as started*).

Every row is built in its own ``worker --serve`` process from its framework's tune inputs (the rows of
a framework from the same weights and batches).
Each framework's first process measures the matmul peaks (``roofline.py``) before it builds anything.
The rows then step in interleaved rounds driven from this process (``timing.run_rounds``), so every
speed-up is paired: the median over shared rounds of (baseline seconds / row seconds), with its 95 %
bootstrap interval, where the baseline is the float32 row with the lowest median step. Each row also
shows its share of its framework's matmul peak for its compute dtype, and its loss after the last
shared step beside its framework's float32 loss. The verdict sets the fastest bf16 row of any framework
against that baseline.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import PolyampError
from ..timing import LOCKSTEP, CaseError, paired_ratio, run_rounds
from ..tune import allocator
from . import interpreters
from .flops import train_step_flops
from .lockstep import Served, roofline_of
from .plots import PALETTE, new_figure
from .roofline import share
from .rows import BASELINE_POLICY
from .workloads import get_workload

POLICIES = ("float32", "bf16-mixed")
TARGET = 1.6  # issue 16: the best bf16 step of any framework over the best float32 step of any framework
TUNED_STEPS = 40
PROCESS_SETTINGS = ({}, allocator.ENV) if allocator.available() else ({},)  # each row once per setting
ABOUT = ("Each framework's tuned float32 and bf16-mixed configurations (its `polyamp tune` reports), each in "
         "its own process (a framework's rows from the same weights and batches), stepped in interleaved "
         "rounds. *vs best fp32*: "
         "the median over shared rounds of (fastest float32 row's seconds / the row's), with its 95 % "
         "bootstrap interval; *vs own fp32*: the same against its framework's float32 row; *share of peak*: "
         "model matmul FLOPs per step over the median step, over the framework's measured matmul peak for "
         "the compute dtype; *loss*: after the last step shared with its framework's float32 row; *vs as "
         "started*: a `malloc=heap` row (its process started with " + allocator.SHELL + ") over its twin "
         "whose process started as it was.")


@dataclass
class TunedRow:
    """One tuned configuration in its own process, and what the rounds measured."""

    framework: str
    workload: str
    policy: str
    settings: dict
    env: dict = field(default_factory=dict)
    status: str = "ok"
    error: str | None = None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    median_s: float | None = None
    speedup: float | None = None  # over the baseline row
    ci95: list[float] | None = None
    rounds: int = 0
    own_float32: float | None = None  # over its framework's float32 row with the same process settings
    own_ci95: list[float] | None = None
    vs_as_started: float | None = None  # over the same configuration without the process settings
    vs_as_started_ci95: list[float] | None = None
    gflops: float | None = None
    roofline_share: float | None = None
    loss: float | None = None  # after the last step shared with its framework's float32 row
    float32_loss: float | None = None

    @property
    def label(self) -> str:
        knobs = " ".join(f"{k}={v}" for k, v in sorted(self.settings.items()))
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        env = "malloc=heap" if self.env == allocator.ENV else env
        return " ".join(x for x in (self.framework, self.policy, knobs, env) if x)


def report_path(folder: Path, framework: str, workload: str) -> Path:
    return folder / f"{framework}-{workload}.json"


def ensure_reports(folder: Path, frameworks: list[str], workloads: list[str], budget: float, quick: bool,
                   say: Callable[[str], None]) -> dict:  # fmt: skip
    """Each (framework, workload)'s tune report, read from ``folder`` or made there by ``polyamp tune``."""
    reports = {}
    for fw in frameworks:
        for wl in workloads:
            path = report_path(folder, fw, wl)
            if not path.exists():
                say(f"no {path}: running polyamp tune --framework {fw} --workloads {wl} --budget {budget:g}")
                cmd = [interpreters.interpreter(fw), "-m", "polyamp", "tune", "--framework", fw,
                       "--workloads", wl, "--budget", str(budget), "--out", str(folder),
                       *(["--quick"] if quick else [])]
                done = subprocess.run(cmd, env=interpreters.child_env(), stdout=subprocess.DEVNULL)
                if done.returncode != 0 or not path.exists():
                    raise PolyampError(f"polyamp tune for {fw} {wl} failed (exit {done.returncode})")
            reports[fw, wl] = json.loads(path.read_text(encoding="utf-8"))
    return reports


def rows_for(reports: dict, frameworks: list[str], workload: str) -> list[TunedRow]:
    rows = []
    for fw in frameworks:
        tuned = reports[fw, workload]["tuned"]
        for env in PROCESS_SETTINGS:
            for policy in POLICIES:
                if policy not in tuned:
                    raise PolyampError(f"the tune report of {fw} {workload} has no {policy} configuration; "
                                       f"it has {', '.join(tuned)}: run polyamp tune with --policies "
                                       "bf16-mixed")  # fmt: skip
                rows.append(TunedRow(fw, workload, policy, dict(tuned[policy]["settings"]), dict(env)))
    return rows


def run_workload(rows: list[TunedRow], quick: bool, steps: int, budget: float, timeout: float,
                 tmp: Path, say: Callable[[str], None]) -> dict:  # fmt: skip
    """Build every row in its own process, step them in rounds, fill in the rows; the rooflines."""
    rooflines, procs = {}, {}
    try:
        for k, row in enumerate(rows):
            python = interpreters.interpreter(row.framework)
            served = Served(python, {**interpreters.child_env(), **row.env}, tmp / f"{row.workload}-{k}.log")
            procs[k] = served
            if row.framework not in rooflines:
                say(f"{row.framework}: matmul peaks")
                rooflines[row.framework] = roofline_of(served, row.framework, quick, timeout)
            say(f"build {row.label}")
            try:
                built = served.call(timeout, op="build_tuned", framework=row.framework, workload=row.workload,
                                    policy=row.policy, settings=row.settings, quick=quick, env=list(row.env))
            except CaseError as err:
                row.status, row.error = err.status, err.error
                continue
            if built["env"] != row.env:
                row.status, row.error = "failed", f"the row's process saw {built['env']}, not {row.env}"
        live = {k: procs[k] for k, row in enumerate(rows) if row.status == "ok"}
        say(f"{len(live)} rows in rounds ({budget:g} s of steps each)")
        steppers = {k: (lambda i, p=p: p.call(timeout, op="step", i=i)["seconds"]) for k, p in live.items()}
        times = run_rounds(steppers, steps, budget, count_warmup=not quick)
        for k, t in times.items():
            row = rows[k]
            row.times = t.times
            if t.status != "ok":
                row.status, row.error = t.status, t.error
                continue
            try:
                row.losses = live[k].call(timeout, op="result", evaluate=False)["losses"]
            except CaseError as err:  # its process died after its last step: its times still count
                row.error = f"no losses: {err.error}"
    finally:
        for served in procs.values():
            served.close()
    _score(rows, times, rooflines, quick)
    return rooflines


def _score(rows: list[TunedRow], times: dict, rooflines: dict, quick: bool) -> None:
    """Each row's median, roofline share, paired speed-ups and loss beside its float32 row."""
    flops = train_step_flops(get_workload(rows[0].workload, quick=quick))
    ok = [k for k, row in enumerate(rows) if row.status == "ok" and row.times]
    for k in ok:
        rows[k].median_s = statistics.median(rows[k].times)
        s = share(rows[k].policy, flops, rows[k].median_s, rooflines.get(rows[k].framework))
        rows[k].gflops, rows[k].roofline_share = s.achieved_gflops, s.share
    base = baseline(rows)
    for k in ok:
        row = rows[k]
        if base is not None:
            ratio = paired_ratio(times[base], times[k], rows[base].label, LOCKSTEP)
            if ratio is not None:
                row.speedup, row.ci95, row.rounds = ratio.speedup, list(ratio.ci95 or []), ratio.rounds
        twin = next((j for j in ok if row.env and rows[j].framework == row.framework and not rows[j].env
                     and rows[j].policy == row.policy), None)  # fmt: skip
        if twin is not None:
            ratio = paired_ratio(times[twin], times[k], rows[twin].label, LOCKSTEP)
            if ratio is not None:
                row.vs_as_started, row.vs_as_started_ci95 = ratio.speedup, list(ratio.ci95 or [])
        own = next((j for j in ok if rows[j].framework == row.framework and rows[j].env == row.env
                    and rows[j].policy == "float32"), None)  # fmt: skip
        if own is None:
            continue
        if own != k:
            ratio = paired_ratio(times[own], times[k], rows[own].label, LOCKSTEP)
            if ratio is not None:
                row.own_float32, row.own_ci95 = ratio.speedup, list(ratio.ci95 or [])
        n = min(len(row.losses), len(rows[own].losses))
        if n:
            row.loss, row.float32_loss = row.losses[n - 1], rows[own].losses[n - 1]


def baseline(rows: list[TunedRow]) -> int | None:
    """The index of the float32 row with the lowest median step."""
    fp32 = [k for k, r in enumerate(rows) if r.policy == "float32" and r.median_s is not None]
    return min(fp32, key=lambda k: rows[k].median_s) if fp32 else None


def verdict(rows: list[TunedRow]) -> dict:
    """The fastest bf16 row against the fastest float32 row, paired, and the issue's 1.6x target."""
    base = baseline(rows)
    bf16 = [r for r in rows if r.policy != "float32" and r.speedup is not None]
    if base is None or not bf16:
        return {"workload": rows[0].workload, "met": None, "text": "no float32 or no bf16 row ran"}
    best = max(bf16, key=lambda r: r.speedup)
    met = best.speedup >= TARGET
    interval = f" (95 % interval {best.ci95[0]:.2f}-{best.ci95[1]:.2f}, {best.rounds} rounds)" \
        if best.ci95 else ""
    text = (f"{rows[0].workload}: best bf16 [{best.label}] {best.median_s * 1e3:.1f} ms vs best float32 "
            f"[{rows[base].label}] {rows[base].median_s * 1e3:.1f} ms: {best.speedup:.2f}x{interval}; "
            f"target {TARGET}x {'met' if met else 'not met'}")  # fmt: skip
    return {"workload": rows[0].workload, "best_bf16": best.label, "best_float32": rows[base].label,
            "speedup": best.speedup, "ci95": best.ci95, "met": met, "text": text}  # fmt: skip


def markdown(results: dict) -> str:
    out = ["# polyamp compare --tuned", "", ABOUT, ""]
    for wl, res in results["workloads"].items():
        out += [f"## {wl}", "", "**" + res["verdict"]["text"] + "**", "",
                "| row | median step ms | vs best fp32 (95 %) | vs own fp32 | vs as started (95 %) | "
                "GFLOP/s | share of peak | loss (own fp32) | rounds |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in res["rows"]:
            if r["status"] != "ok":
                out.append(f"| {_label(r)} | {r['status']}: {(r['error'] or '')[:120]} | | | | | | | |")
                continue
            ci = f" ({r['ci95'][0]:.2f}-{r['ci95'][1]:.2f})" if r["ci95"] else ""
            own = f"{r['own_float32']:.2f}x" if r["own_float32"] else "—"
            pct = f"{r['roofline_share']:.0%}" if r["roofline_share"] is not None else "n/a"
            loss = f"{r['loss']:.4f} ({r['float32_loss']:.4f})" if r["loss"] is not None else "—"
            twin = r.get("vs_as_started_ci95")
            started = _x(r.get("vs_as_started")) + (f" ({twin[0]:.2f}-{twin[1]:.2f})" if twin else "")
            out.append(f"| {_label(r)} | {r['median_s'] * 1e3:.1f} | {_x(r['speedup'])}{ci} | {own} | "
                       f"{started} | {r['gflops']:.0f} | {pct} | {loss} | {r['rounds']} |")  # fmt: skip
        peaks = ", ".join(f"{fw} fp32 {p['gflops'].get('float32', math.nan):.0f} / bf16 "
                          f"{p['gflops'].get('bfloat16', math.nan):.0f}"
                          for fw, p in res["rooflines"].items())  # fmt: skip
        out += ["", f"Matmul peaks, GFLOP/s: {peaks}.", ""]
    return "\n".join(out)


def _label(r: dict) -> str:
    return TunedRow(**{k: r[k] for k in ("framework", "workload", "policy", "settings", "env")}).label


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def run(frameworks: list[str] | None, workloads: list[str] | None, folder: Path, tune_budget: float,
        quick: bool, steps: int | None, budget: float, timeout: float, out: Path,
        say: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Reports in ``folder`` (made when missing), rows in rounds per workload; writes tuned.json/.md/.png."""
    from ..tune import BUILT_ON

    frameworks = frameworks or [f for f in BUILT_ON if interpreters.interpreter(f)]
    for fw in frameworks:
        if fw not in BUILT_ON:
            raise PolyampError(f"compare --tuned takes frameworks that polyamp tune is built for "
                               f"({', '.join(BUILT_ON)}); received {fw!r}")  # fmt: skip
        interpreters.check_framework(fw)
    workloads = workloads or ["mlp", "charlm"]
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    reports = ensure_reports(folder, frameworks, workloads, tune_budget, quick, say)
    results = {"frameworks": frameworks, "tuned_folder": str(folder), "budget_s": budget, "quick": quick,
               "machine": interpreters.machine(), "workloads": {}}  # fmt: skip
    for wl in workloads:
        rows = rows_for(reports, frameworks, wl)
        with tempfile.TemporaryDirectory() as tmp:
            rooflines = run_workload(rows, quick, steps or TUNED_STEPS, budget, timeout, Path(tmp), say)
        results["workloads"][wl] = {"rows": [asdict(r) for r in rows], "rooflines": rooflines,
                                    "verdict": verdict(rows)}  # fmt: skip
    results["total_s"] = round(time.perf_counter() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuned.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    (out / "tuned.md").write_text(markdown(results), encoding="utf-8")
    tuned_figure(results).savefig(out / "tuned.png")
    return results


def tuned_figure(results: dict):
    """``compare --tuned``: per workload, each row's median step (horizontal bars; float32 black), its
    paired speed-up over the fastest float32 row and share of the matmul peak; the dotted line is the
    step the 1.6x target asks of bf16."""
    workloads = results["workloads"]
    bars = sum(len(w["rows"]) for w in workloads.values())
    fig = new_figure(10.0, 1.2 + 0.45 * bars + 0.6 * len(workloads))
    axes = fig.subplots(len(workloads), 1, squeeze=False)[:, 0]
    for ax, res in zip(axes, workloads.values()):
        rows = res["rows"]
        labels = [TunedRow(**{k: r[k] for k in ("framework", "workload", "policy", "settings", "env")}).label
                  for r in rows]  # fmt: skip
        ms = [r["median_s"] * 1e3 if r["median_s"] else 0.0 for r in rows]
        colors = ["black" if r["policy"] == BASELINE_POLICY else PALETTE[0] for r in rows]
        ax.barh(range(len(rows)), ms, color=colors)
        for y, (r, v) in enumerate(zip(rows, ms)):
            if r["status"] != "ok" or not r["median_s"]:
                text = f" {r['status']}"
            else:
                pct = f", {r['roofline_share']:.0%} of peak" if r["roofline_share"] is not None else ""
                text = f" {v:.3g} ms, {_x_best(r['speedup'])}{pct}"
            ax.text(v, y, text, va="center", fontsize=8)
        fp32 = [v for r, v in zip(rows, ms) if r["policy"] == BASELINE_POLICY and v > 0]
        if fp32:
            ax.axvline(min(fp32) / TARGET, color="grey", linestyle=":", label=f"best float32 / {TARGET}")
            ax.legend(loc="best")
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, max(ms + [1.0]) * 1.8)
        ax.set_xlabel("median step, ms (lower is faster)")
        ax.set_title(textwrap.fill(res["verdict"]["text"], 100), fontsize=8)
    fig.suptitle("Tuned configurations of every framework, stepped side by side (paired rounds)")
    fig.tight_layout()
    return fig


def _x_best(value) -> str:
    return "—" if value is None else f"{value:.2f}x best fp32"
