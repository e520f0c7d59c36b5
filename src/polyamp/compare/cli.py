"""``polyamp compare``: plan, run with a progress bar, report; exit 1 when a case crashed."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone

from ..errors import PolyampError
from ..training_state import UPDATES
from . import interpreters, runner


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _split_policies(value: str | None) -> list[str] | None:
    """``--policies``: comma-separated, where a policy's own options continue it
    (``float32,bf16-true:sr,states=int8`` is two policies)."""
    out: list[str] = []
    for part in _split(value) or []:
        key = part.partition("=")[0].strip().lower()
        if out and ":" in out[-1] and (key in ("states", "update", "weights") or part.lower() in UPDATES):
            out[-1] += "," + part
        else:
            out.append(part)
    return out or None


def compare(args) -> int:
    """Run the cases ``args`` name and write the report; 0, or 1 when a case failed or timed out.

    An ``unsupported`` case (the framework refuses the request on this machine) is reported, not a crash.
    With ``--converge``: :func:`converge`.
    """
    if getattr(args, "mxnet_python", None):
        os.environ["POLYAMP_MXNET_PYTHON"] = args.mxnet_python  # mxnet_python() checks that it exists
    if getattr(args, "converge", False):
        return converge(args)
    if getattr(args, "tuned", None):
        return tuned(args)
    for option in ("seeds", "converge_budget"):
        if getattr(args, option, None) is not None:
            raise PolyampError(f"--{option.replace('_', '-')} applies to --converge only; got it without")
    runner.check_options(args.steps, args.budget, args.timeout)
    cases = runner.plan(_split(args.frameworks), _split(args.workloads), _split_policies(args.policies))
    started = time.perf_counter()
    records = _run_with_progress(cases, args)
    from .report import terminal_table, write_report

    settings = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": _command(),
        "quick": args.quick,
        "steps": args.steps,
        "budget_s": args.budget,
        "infer_budget_s": getattr(args, "infer_budget", None),
        "timeout_s": args.timeout,
        "machine": interpreters.machine(),
        "total_s": round(time.perf_counter() - started, 1),
    }
    paths = write_report(records, settings, args.out)
    with open(paths["json"], encoding="utf-8") as f:
        report = json.load(f)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(terminal_table(report["rows"], smoke=args.quick))
        print(f"\n{len(records)} cases in {settings['total_s']:.0f} s. Report: {paths['markdown']}")
        print("Plots: " + ", ".join(str(p) for p in paths["plots"]))
    missing = sorted({r["framework"] for r in records if r.get("status") == interpreters.NOT_INSTALLED})
    for name in missing:
        how = interpreters.HOW_TO_INSTALL[name]
        print(f"polyamp compare: {name} is not installed here: {how}", file=sys.stderr)
    crashed = [r for r in records if r.get("status") in runner.CRASHED]
    if not crashed:
        return 0
    print(f"polyamp compare: {len(crashed)} of {len(records)} cases crashed:", file=sys.stderr)
    for r in crashed:
        error = " ".join(str(r.get("error")).split())
        error = error if len(error) <= 300 else error[:299] + "…"  # report.md has the whole text
        print(f"  {r['framework']} {r['workload']} {r['policy']}: {r['status']}: {error}", file=sys.stderr)
    return 1


def _run_with_progress(cases, args):
    kwargs = dict(quick=args.quick, steps=args.steps, budget=args.budget, timeout=args.timeout,
                  infer_budget=getattr(args, "infer_budget", None))
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:

        def show(i, case, record):
            if record is None:
                print(f"[{i + 1}/{len(cases)}] {' '.join(case)} ...", file=sys.stderr, flush=True)

        return runner.run(cases, progress=show, **kwargs)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn()]  # fmt: skip
    from rich.console import Console

    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("compare", total=len(cases))

        def show(i, case, record):
            if record is None:
                bar.update(task, description=f"{case[0]} {case[1]} {case[2]}")
            else:
                bar.advance(task)

        return runner.run(cases, progress=show, **kwargs)


def converge(args) -> int:
    """``--converge``: every (framework, workload, policy) over ``--seeds`` seeds to its target
    (``converge.py``), summarized with the parity test (``convergence.py``); 0, or 1 when a run crashed."""
    from . import convergence
    from .converge import DEFAULT_BUDGET_S, DEFAULT_SEEDS, make_plan, slots

    seeds = DEFAULT_SEEDS if args.seeds is None else args.seeds
    budget = DEFAULT_BUDGET_S if args.converge_budget is None else args.converge_budget
    plan = make_plan(_split(args.frameworks), _split(args.workloads), _split_policies(args.policies), seeds,
                     budget, args.quick, args.steps)  # fmt: skip
    started = time.perf_counter()
    jobs, threads = slots(plan)
    runs = _converge_with_progress(plan, jobs)
    settings = convergence.Settings(
        plan=plan, every={w: plan.every(w) for w in plan.workloads},
        steps={w: plan.steps_for(w) for w in plan.workloads}, jobs=jobs,
        threads_per_job=threads,
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"), command=_command(),
        machine=interpreters.machine(), wall_s=round(time.perf_counter() - started, 1),
    )  # fmt: skip
    summaries = convergence.summarize(runs)
    paths = convergence.write(settings, runs, summaries, args.out)
    if args.json:
        print(paths["json"].read_text(encoding="utf-8"))
    else:
        print(convergence.terminal_table(summaries))
        print(f"\n{len(runs)} runs in {settings.wall_s:.0f} s. Report: {paths['markdown']}, "
              f"figure: {paths['figure']}")  # fmt: skip
    for name in sorted({r.framework for r in runs if r.status == interpreters.NOT_INSTALLED}):
        how = interpreters.HOW_TO_INSTALL[name]
        print(f"polyamp compare: {name} is not installed here: {how}", file=sys.stderr)
    crashed = [r for r in runs if r.status in runner.CRASHED]
    if not crashed:
        return 0
    print(f"polyamp compare: {len(crashed)} of {len(runs)} runs crashed:", file=sys.stderr)
    for r in crashed:
        error = " ".join(str(r.error).split())
        error = error if len(error) <= 300 else error[:299] + "…"  # convergence.md has the whole text
        print(f"  {r.framework} {r.workload} {r.policy} seed {r.seed}: {r.status}: {error}", file=sys.stderr)
    return 1


def tuned(args) -> int:
    """``--tuned``: every framework's tuned float32 and bf16 rows side by side (``tuned.py``); 0, or 1
    when a row crashed."""
    from pathlib import Path

    from . import tuned as tuned_rows

    if args.policies:
        raise PolyampError("--tuned compares each framework's tuned float32 and bf16-mixed rows; it takes no "
                           f"--policies (got {args.policies!r})")  # fmt: skip
    runner.check_options(args.steps, args.budget, args.timeout)

    def say(text: str) -> None:
        if not args.json:
            print(f"[compare --tuned] {text}", file=sys.stderr, flush=True)

    results = tuned_rows.run(_split(args.frameworks), _split(args.workloads), Path(args.tuned),
                             args.tune_budget, args.quick, args.steps, args.budget, args.timeout,
                             Path(args.out), say)  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(tuned_rows.markdown(results))
        print(f"\nReport: {Path(args.out) / 'tuned.md'}, plot: {Path(args.out) / 'tuned.png'}")
    crashed = [r for w in results["workloads"].values() for r in w["rows"] if r["status"] in runner.CRASHED]
    for r in crashed:
        print(f"polyamp compare --tuned: {r['framework']} {r['workload']} {r['policy']}: {r['status']}: "
              f"{' '.join(str(r['error']).split())[:300]}", file=sys.stderr)  # fmt: skip
    return 1 if crashed else 0


def _command() -> str | None:
    """The command line, when this process is ``polyamp compare`` (or ``python -m polyamp compare``)."""
    return "polyamp " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["compare"] else None


def _converge_with_progress(plan, jobs: int):
    from .converge import run_all

    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:

        def show(run, done):
            if not done:
                print(f"{run.framework} {run.workload} {run.policy} seed {run.seed} ...", file=sys.stderr,
                      flush=True)  # fmt: skip

        return run_all(plan, progress=show, jobs=jobs)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn()]  # fmt: skip
    active: dict = {}
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("converge", total=len(plan.runs()))

        def show(run, done):
            key = (run.framework, run.policy)
            if done:
                active.pop(key, None)
                bar.advance(task)
            else:
                active[key] = f"{run.framework} {run.workload} {run.policy} s{run.seed}"
            bar.update(task, description=" | ".join(active.values()) or "converge")

        return run_all(plan, progress=show, jobs=jobs)
