"""Do ``polyamp compare``'s speed-ups reproduce on a disturbed machine? Two back-to-back runs.

    python benchmarks/compare_reproducibility.py --frameworks torch,jax [--workloads mlp,charlm]

Run 1 is a plain ``polyamp compare``; run 2 is the same command while a CPU-bound process (a busy
loop pinned to core 0, started before run 2 and stopped after it by this script, and ending by
itself after ``--busy-limit`` seconds in any case) keeps one core busy. For every mixed-precision
case's training and inference speed-up resting on at least ``--min-rounds`` paired rounds in both
runs, the table shows
both speed-ups with their 95 % intervals and their relative difference |r2 / r1 - 1|; they agree
when it is at most ``--tolerance``. Exit status: 0 when every such speed-up agrees, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUSY = "import time\ndeadline = time.monotonic() + {limit}\nwhile time.monotonic() < deadline:\n    pass\n"


def compare(args, out: Path) -> tuple[list[dict], float]:
    """One ``polyamp compare`` run: its report's rows and its wall time."""
    cmd = [sys.executable, "-m", "polyamp", "compare", "--frameworks", args.frameworks, "--out", str(out)]
    if args.workloads:
        cmd += ["--workloads", args.workloads]
    if args.policies:
        cmd += ["--policies", args.policies]
    if args.budget:
        cmd += ["--budget", str(args.budget)]
    print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    start, load = time.perf_counter(), os.getloadavg()[0]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    doc = json.loads((out / "report.json").read_text())
    loads = [x for c in doc["cases"] for x in c.get("loadavg_1min") or []]
    print(f"  {wall:.0f} s; 1-minute load average {load:.1f} at the start, {min(loads or [0]):.1f}-"
          f"{max(loads or [0]):.1f} over its pair groups ({os.cpu_count()} cores)", file=sys.stderr)
    return doc["rows"], wall


def busy_core(limit: float) -> subprocess.Popen:
    """A single-threaded busy loop on core 0 (on any one core where affinity is not supported)."""
    pin = (lambda: os.sched_setaffinity(0, {0})) if hasattr(os, "sched_setaffinity") else None
    return subprocess.Popen([sys.executable, "-c", BUSY.format(limit=limit)], preexec_fn=pin)


def speedups(row: dict) -> dict[str, dict]:
    """The row's training and inference speed-ups (each: speedup, speedup_ci95, speedup_rounds)."""
    return {"train": row, "infer": row.get("inference") or {}}


def cell(ratio: dict, status: str | None) -> str:
    if ratio.get("speedup") is None:
        return status or "n/a"
    ci, n = ratio.get("speedup_ci95"), ratio.get("speedup_rounds")
    text = f"{ratio['speedup']:.3g}x"
    if ci:
        text += f" [{ci[0]:.3g}-{ci[1]:.3g}]"
    return text + (f" n={n}" if n is not None else " unpaired")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--workloads", default=None, help="default: compare's (every workload)")
    parser.add_argument("--policies", default=None)
    parser.add_argument("--budget", type=float, default=None, help="default: compare's")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--min-rounds", type=int, default=5)
    parser.add_argument("--busy-limit", type=float, default=1800.0)
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "polyamp-compare-reproducibility"))
    args = parser.parse_args()
    out = Path(args.out)
    first, wall1 = compare(args, out / "run1")
    busy = busy_core(args.busy_limit)
    try:
        second, wall2 = compare(args, out / "run2")
    finally:
        busy.kill()
        busy.wait()
    print(f"run 1: {wall1:.0f} s; run 2 (one core busy): {wall2:.0f} s")
    by_case = {(r["framework"], r["workload"], r["policy"]): r for r in second}
    header = f"{'case':40s} {'run 1':28s} {'run 2 (one core busy)':28s} {'diff':>6s}  verdict"
    print(header + "\n" + "-" * len(header))
    compared = agreed = 0
    for r1, kind in ((r, kind) for r in first for kind in ("train", "infer")):
        key = (r1["framework"], r1["workload"], r1["policy"])
        r2 = by_case.get(key)
        if r1["policy"] == "float32" or r2 is None:
            continue
        s1, s2 = speedups(r1)[kind], speedups(r2)[kind]
        if kind == "infer" and not (s1 or s2):
            continue
        rounds = [s.get("speedup_rounds") or 0 for s in (s1, s2)]
        if s1.get("speedup") and s2.get("speedup"):
            diff = abs(s2["speedup"] / s1["speedup"] - 1)
            diff_text = f"{diff:6.1%}"
        else:
            diff, diff_text = None, "     -"
        if diff is None:
            verdict = "not judged (no speed-up)"
        elif min(rounds) < args.min_rounds:
            verdict = f"not judged (rests on {min(rounds)} < {args.min_rounds} rounds)"
        else:
            compared += 1
            agreed += diff <= args.tolerance
            verdict = "agree" if diff <= args.tolerance else f"DIFFER (> {args.tolerance:.0%})"
        label = " ".join(key) + f" {kind}"
        print(f"{label:40s} {cell(s1, r1.get('status')):28s} {cell(s2, r2.get('status')):28s} {diff_text}  "
              f"{verdict}")
    print(f"\n{agreed} of {compared} speed-ups resting on >= {args.min_rounds} rounds in both runs agree "
          f"within {args.tolerance:.0%}.")
    return 0 if agreed == compared else 1


if __name__ == "__main__":
    sys.exit(main())
