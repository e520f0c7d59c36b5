"""Plans the (framework, workload, policy) cases and runs them in worker subprocesses.

The policies of one (framework, workload) are timed together, in interleaved rounds, so that each
speed-up is paired (``worker.py``, ``timing.py``): one fresh process per (framework, workload), one
at a time, or for MXNet, whose AMP is process-wide, one process per policy stepped in lock-step
(``lockstep.py``). A smoke run (``quick``) instead shares one process per framework (per policy for
MXNet), so it pays each framework's import once, and runs such jobs one per core side by side. A
case that crashes or runs past ``timeout`` is recorded with its error text and the run goes on.
float32 runs first for each (framework, workload): it is the baseline every other policy is
compared with.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from numbers import Real
from pathlib import Path

from ..errors import PolyampError
from . import interpreters
from .interpreters import FRAMEWORKS, HOW_TO_INSTALL, NOT_INSTALLED
from .lockstep import run_lockstep
from .pairing import BASELINE, infer_budget_for, pair_groups
from .workloads import WORKLOADS, check_steps, get_workload

DEFAULT_POLICIES = ("float32", "bf16-mixed", "fp16-mixed")
# contrib.amp patches MXNet's operators for the whole process, in one dtype: one process per policy
_AMP_PER_PROCESS = ("mxnet",)
CRASHED = ("failed", "timeout")  # the statuses of a case that crashed; "unsupported" is not one


def plan(frameworks=None, workloads=None, policies=None) -> list[tuple[str, str, str]]:
    """The cases to run, float32 first within each (framework, workload). Without ``frameworks``:
    all four, a framework that is not installed getting records that say how to install it."""
    named = frameworks is not None
    frameworks = list(frameworks or FRAMEWORKS)
    for name in frameworks:
        if named or name not in FRAMEWORKS:
            interpreters.check_framework(name)
    workloads = list(workloads or WORKLOADS)
    for name in workloads:
        if name not in WORKLOADS:
            raise PolyampError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    from ..mixed_precision import recipe_of
    from ..policy import Policy
    from ..recipes import recipe_spec, refusal

    policies = [recipe_spec(recipe_of(p)) if recipe_of(p) else Policy.parse(p).name
                for p in (policies or DEFAULT_POLICIES)]  # fmt: skip
    policies.sort(key=lambda p: p != "float32")
    for policy in policies:
        for framework in frameworks if recipe_of(policy) else ():
            why = refusal(recipe_of(policy), framework)
            if why is not None:
                raise PolyampError(f"--policies {policy} on --frameworks {framework}: {why}")
    return [(f, w, p) for f in frameworks for w in workloads for p in policies]


def check_options(steps=None, budget: float = 6.0, timeout: float = 300.0) -> None:
    """Refuse a step count, budget or timeout that no case could run with, before any case starts."""
    check_steps(steps)
    for name, value in (("budget", budget), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < math.inf:
            raise PolyampError(f"{name} must be a finite number of seconds > 0; got {value!r}")


def run(cases, quick=False, steps=None, budget=6.0, timeout=300.0, progress: Callable | None = None,
        reuse: bool | None = None, jobs: int | None = None,
        infer_budget: float | None = None) -> list[dict]:  # fmt: skip
    """Run every case; returns their records in the order of ``cases``.

    The cases of one (framework, workload) are a pair group (``worker.py``): their policies step in
    interleaved rounds in one process, MXNet's in one process per policy stepped in lock-step
    (``lockstep.py``), as its AMP is process-wide. ``reuse`` (default: ``quick``) runs all the
    groups of a framework in one worker process (MXNet: one per policy), so a smoke run pays each
    framework's import once; otherwise every group has fresh processes. ``jobs`` worker processes
    run at once (default: one per core for a smoke run, whose timings are no measurement; else 1, so
    that no group's timing shares the machine with another). The first process of each framework
    first measures its matmul roofline, and every record gets its share of it (``roofline``).
    A process that crashes or runs past ``timeout`` per case costs the group it was on: the groups
    after it get a new process. ``progress(i, case, record)`` is called with ``record=None`` as a
    case's group starts and with its record when it ends; ``i`` counts the cases finished before.
    ``infer_budget``: seconds of inference calls per policy (default: the worker's, a quarter of
    ``budget``).
    """
    check_options(steps, budget, timeout)
    infer_budget_for(budget, infer_budget)  # refuses a bad one before any case starts
    cases = [tuple(case) for case in cases]
    for case in cases:
        if len(case) != 3:
            raise PolyampError(f"a case is (framework, workload, policy); got {case!r}")
        if case[0] not in FRAMEWORKS:
            raise PolyampError(f"unknown framework {case[0]!r}; accepted: {', '.join(FRAMEWORKS)}")
    reuse = quick if reuse is None else reuse
    if jobs is None:
        jobs = (os.cpu_count() or 1) if quick else 1
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise PolyampError(f"jobs must be a whole number >= 1; got {jobs!r}")
    records: list = [None] * len(cases)
    rooflines: dict = {}
    finished = 0
    lock = threading.Lock()

    def notify(index: int, record: dict | None) -> None:
        nonlocal finished
        with lock:
            if record is not None:
                records[index] = record
            if progress:
                progress(finished, cases[index], record)
            finished += record is not None

    def run_job(job: list[int], roofline: bool) -> None:
        framework = cases[job[0]][0]
        with tempfile.TemporaryDirectory() as tmp:
            if framework in _AMP_PER_PROCESS:
                python = interpreters.interpreter(framework)
                measured = run_lockstep([cases[i] for i in job], python, interpreters.child_env(), Path(tmp),
                                        quick, steps, budget, timeout, lambda k, r: notify(job[k], r),
                                        roofline, infer_budget)  # fmt: skip
            else:
                measured = _run_processes(job, roofline, Path(tmp))
        if measured:
            rooflines[framework] = measured

    def _run_processes(job: list[int], roofline: bool, tmp: Path) -> dict | None:
        measured = None
        while job:
            path = tmp / "roofline.json" if roofline and not measured else None
            done, roof = _run_in_process([cases[i] for i in job], quick, steps, budget, timeout,
                                         lambda k, record, job=job: notify(job[k], record), path,
                                         infer_budget)  # fmt: skip
            measured = measured or roof
            job = job[done:]
        return measured

    missing = [i for i, case in enumerate(cases) if interpreters.interpreter(case[0]) is None]
    for i in missing:
        notify(i, None)
        notify(i, _error_record(cases[i], NOT_INSTALLED, HOW_TO_INSTALL[cases[i][0]]))
    present = [i for i in range(len(cases)) if i not in missing]
    job_list = [[present[k] for k in job] for job in _jobs([cases[i] for i in present], reuse)]
    firsts, seen = [], set()  # the first job of each framework measures its roofline
    for job in job_list:
        firsts.append(cases[job[0]][0] not in seen)
        seen.add(cases[job[0]][0])
    if jobs == 1 or len(job_list) <= 1:
        for job, first in zip(job_list, firsts):
            run_job(job, first)
    else:
        with ThreadPoolExecutor(min(jobs, len(job_list))) as pool:
            for future in [pool.submit(run_job, job, first) for job, first in zip(job_list, firsts)]:
                future.result()
    attach_rooflines(records, rooflines, quick, steps)
    return records


def attach_rooflines(records: list[dict], rooflines: dict, quick: bool, steps) -> None:
    """Give every timed record its framework's peaks (``roofline_peaks``) and its share (``roofline``)."""
    from .flops import train_step_flops
    from .roofline import share

    for record in records:
        peaks = rooflines.get(record.get("framework"))
        if peaks is None or record.get("status") != "ok" or not record.get("median_step_s"):
            continue
        flops = train_step_flops(get_workload(record["workload"], quick=quick, steps=steps))
        record["roofline_peaks"] = peaks
        record["roofline"] = asdict(share(record["policy"], flops, record["median_step_s"], peaks))


def _jobs(cases: list, reuse: bool) -> list[list[int]]:
    """Indices of the cases that one job runs (one worker process, or MXNet's processes of one
    pair group), in first-seen order; within a job, by workload with float32 first, so that each
    (framework, workload)'s cases are consecutive: a pair group."""
    jobs: dict = {}
    for i, (framework, workload, _) in enumerate(cases):
        jobs.setdefault(framework if reuse else (framework, workload), []).append(i)
    order: dict = {}
    for _, workload, _ in cases:
        order.setdefault(workload, len(order))

    def key(i: int) -> tuple:
        return order[cases[i][1]], cases[i][2] != BASELINE, i

    return [sorted(job, key=key) for job in jobs.values()]


def _run_in_process(cases: list, quick, steps, budget, timeout, notify: Callable,
                    roofline: Path | None = None,
                    infer_budget: float | None = None) -> tuple[int, dict | None]:  # fmt: skip
    """Run ``cases`` (one framework) in order in one worker process, by pair groups; returns how many
    got a record and the roofline the process measured first (when ``roofline``, its file).

    A group has ``timeout`` seconds per case from the end of the one before (the first: from the
    start of the process). When the process dies or times out, the cases of the group it was on get
    an error record and the count stops at the end of that group."""
    framework = cases[0][0]
    groups = pair_groups(cases)
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "cases.jsonl", Path(tmp) / "output.txt"
        cmd = [interpreters.interpreter(framework), "-m", "polyamp.compare.worker", "--budget", str(budget),
               "--out", str(out)]  # fmt: skip
        if infer_budget is not None:
            cmd += ["--infer-budget", str(infer_budget)]
        for case in cases:
            cmd += ["--case", *case]
        if quick:
            cmd.append("--quick")
        if steps is not None:
            cmd += ["--steps", str(steps)]
        if roofline is not None:
            cmd += ["--roofline", str(roofline)]
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=interpreters.child_env())
        done, g = 0, 0
        for k in groups[0]:
            notify(k, None)
        start = time.perf_counter()
        try:
            while done < len(cases):
                exited = proc.poll() is not None
                for record in read_records(out)[done:]:
                    record.setdefault("wall_s", time.perf_counter() - start)
                    notify(done, record)
                    done += 1
                    if done == groups[g][-1] + 1 and done < len(cases):
                        g += 1
                        start = time.perf_counter()
                        for k in groups[g]:
                            notify(k, None)
                if done == len(cases):
                    break
                limit = timeout * len(groups[g])
                if exited or time.perf_counter() - start > limit:
                    if not exited:
                        proc.kill()
                        status = "timeout"
                        error = (f"no result within the {timeout:g} s timeout of a case "
                                 f"({limit:g} s for this group of {len(groups[g])})")  # fmt: skip
                    else:
                        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                        error, status = f"exit code {proc.returncode}: " + " | ".join(tail), "failed"
                    for k in range(done, groups[g][-1] + 1):
                        notify(k, _error_record(cases[k], status, error))
                    return groups[g][-1] + 1, _read_roofline(roofline)
                time.sleep(0.02)
        finally:
            if proc.poll() is None and done < len(cases):
                proc.kill()
            proc.wait()
    return done, _read_roofline(roofline)


def _read_roofline(path: Path | None) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None


def read_records(path: Path) -> list[dict]:
    """The complete lines of the worker's JSON-lines file (a line being written is left for later)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def _error_record(case, status: str, error: str) -> dict:
    framework, workload, policy = case
    return {"framework": framework, "workload": workload, "policy": policy, "status": status,
            "error": error}  # fmt: skip
