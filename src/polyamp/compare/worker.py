"""Runs compare cases one after another in this process and appends each record to a JSON-lines file.

    python -m polyamp.compare.worker --case torch mlp float32 --case torch mlp bf16-mixed --out cases.jsonl

Measurement: the first step is a warm-up (it trains, but is not timed); every later step is timed
from batch to the loss value on the host, so each framework's queued work is included. A case
stops early once its steps have taken ``--budget`` seconds, and the record says so (if the
warm-up step alone spent the budget, that one step is the measurement). A smoke check
(``--quick``) counts only the timed steps against the budget: its warm-up is mostly tracing and
compiling, slow on a busy machine, and every case should get past it to train and evaluate.
Peak memory is the process's peak resident set size: the case's own in a fresh process, the peak
so far when cases share one (``process_case`` > 0). A case that raises becomes a record with its
error (``unsupported`` when the framework refuses the request here) and the next case runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback

from .workloads import get_workload


def run_case(framework: str, workload: str, policy: str, quick: bool, steps: int | None,
             budget: float, seed: int = 0) -> dict:  # fmt: skip
    start = time.perf_counter()
    record = {"framework": framework, "workload": workload, "policy": policy, "status": "ok",
              "error": None, "capped": False, "cap_reason": None}  # fmt: skip
    wl = get_workload(workload, quick=quick, steps=steps, seed=seed)  # refuses steps < 1
    record["steps_requested"] = wl.steps
    module = importlib.import_module(f"polyamp.compare.{framework}")
    record["versions"] = module.versions()
    record["framework_version"] = record["versions"][framework]
    trainer = module.Trainer(wl, policy)
    losses, scales, durations = [], [], []
    skipped = 0
    for i in range(wl.steps):
        t0 = time.perf_counter()
        losses.append(trainer.step(i))
        durations.append(time.perf_counter() - t0)
        scales.append(trainer.mp.current_scale)
        skipped += not trainer.last.stepped
        if sum(durations[1:] if quick else durations) > budget and i + 1 < wl.steps:
            record["capped"] = True
            record["cap_reason"] = (
                f"stopped after {i + 1} of {wl.steps} steps: the {budget:g} s budget of a case was "
                f"spent (this step took {durations[-1]:.2f} s)"
            )
            break
    times = durations[1:] or durations  # when only the warm-up step ran, it is the measurement
    record["warmup_steps"] = len(durations) - len(times)
    metric, higher = wl.metric
    # A capped case stopped at another step count than float32: its metric would not be comparable.
    value = math.nan if record["capped"] else trainer.evaluate()
    record.update(
        steps=len(losses),
        step_times=times,
        median_step_s=statistics.median(times),
        losses=[x if math.isfinite(x) else None for x in losses],
        scales=scales,
        skipped_steps=skipped,
        eval={
            "metric": metric,
            "value": value if math.isfinite(value) else None,
            "higher_is_better": higher,
        },  # fmt: skip
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        wall_s=time.perf_counter() - start,
    )
    return record


def _record(case: list[str], quick: bool, steps: int | None, budget: float) -> dict:
    """The case's record, or a record of the error it raised."""
    framework, workload, policy = case
    try:
        return run_case(framework, workload, policy, quick, steps, budget)
    except Exception as err:  # the runner reports the error text; the compare run goes on
        return {"framework": framework, "workload": workload, "policy": policy,
                "status": "unsupported" if getattr(err, "unsupported", False) else "failed",
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=8)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, action="append", required=True,
                        metavar=("FRAMEWORK", "WORKLOAD", "POLICY"))  # fmt: skip
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--budget", type=float, default=6.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for index, case in enumerate(args.case):
        record = _record(case, args.quick, args.steps, args.budget)
        record.update(worker_pid=os.getpid(), process_case=index)
        with open(args.out, "a", encoding="utf-8") as f:  # one whole line per case: the runner reads them
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
