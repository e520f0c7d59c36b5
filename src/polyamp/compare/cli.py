"""``polyamp compare``: plan, run with a progress bar, report; exit 1 when a case crashed."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone

from . import runner


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def compare(args) -> int:
    """Run the cases ``args`` name and write the report; 0, or 1 when a case failed or timed out.

    An ``unsupported`` case (the framework refuses the request on this machine) is reported, not a crash.
    """
    runner.check_options(args.steps, args.budget, args.timeout)
    if getattr(args, "mxnet_python", None):
        os.environ["POLYAMP_MXNET_PYTHON"] = args.mxnet_python  # mxnet_python() checks that it exists
    cases = runner.plan(_split(args.frameworks), _split(args.workloads), _split(args.policies))
    started = time.perf_counter()
    records = _run_with_progress(cases, args)
    from .report import terminal_table, write_report

    settings = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "polyamp " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("polyamp") else None,
        "quick": args.quick,
        "steps": args.steps,
        "budget_s": args.budget,
        "timeout_s": args.timeout,
        "machine": runner.machine(),
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
    missing = sorted({r["framework"] for r in records if r.get("status") == runner.NOT_INSTALLED})
    for name in missing:
        how = runner.HOW_TO_INSTALL[name]
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
    kwargs = dict(quick=args.quick, steps=args.steps, budget=args.budget, timeout=args.timeout)
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
