"""Runs one compare case in its own process and writes its record as JSON.

    python -m polyamp.compare.worker --framework torch --workload mlp --policy bf16-mixed --out case.json

Measurement: the first step is a warm-up (it trains, but is not timed); every later step is timed
from batch to the loss value on the host, so each framework's queued work is included. A case
stops early once its steps have taken ``--budget`` seconds, and the record says so (if the
warm-up step alone spent the budget, that one step is the measurement). Peak memory is the
process's peak resident set size.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
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
    wl = get_workload(workload, quick=quick, steps=steps, seed=seed)
    record["steps_requested"] = wl.steps
    module = importlib.import_module(f"polyamp.compare.{framework}")
    record["framework_version"] = module.version()
    trainer = module.Trainer(wl, policy)
    losses, scales, times = [], [], []
    skipped = 0
    spent = 0.0
    for i in range(wl.steps):
        t0 = time.perf_counter()
        losses.append(trainer.step(i))
        elapsed = time.perf_counter() - t0
        spent += elapsed
        scales.append(trainer.mp.current_scale)
        skipped += not trainer.last.stepped
        if i > 0:
            times.append(elapsed)
        if spent > budget and i + 1 < wl.steps:
            record["capped"] = True
            record["cap_reason"] = (
                f"stopped after {i + 1} of {wl.steps} steps: the {budget:g} s budget of a case was "
                f"spent (this step took {elapsed:.2f} s)"
            )
            break
    if not times:  # only the warm-up step ran: it is the measurement
        times = [elapsed]
        record["warmup_steps"] = 0
    else:
        record["warmup_steps"] = 1
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--budget", type=float, default=6.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        record = run_case(args.framework, args.workload, args.policy, args.quick, args.steps, args.budget)
    except Exception as err:  # the runner reports the error text; the compare run goes on
        record = {"framework": args.framework, "workload": args.workload, "policy": args.policy,
                  "status": "unsupported" if getattr(err, "unsupported", False) else "failed",
                  "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc(limit=8)}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
