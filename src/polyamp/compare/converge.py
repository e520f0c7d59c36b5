"""``polyamp compare --converge``: train each case to its workload's target over several seeds.

One run is (framework, workload, policy, seed): the workload at full size (``--quick``: tiny) built
with that seed (weights, data order, split), trained for ``target.max_steps`` steps (or ``steps``),
its held-out metric evaluated before the first step, every ``every`` steps and after the last. It
records the curve, the first evaluated step at which ``wl.reached`` (None if never), the final
metric, the skipped steps and its wall time (build, steps and evaluations).

A run has ``budget`` seconds. It is capped, and its final metric and steps-to-target do not count,
when it spends them, or when after ``PROJECT_AFTER`` steps past its first (which compiles) its pace
projects more than ``PROJECT_MARGIN`` budgets for the whole run (torch fp16 on a CPU is 30-100x
slower than float32: it is stopped, not waited for). The seeds of a capped case that have not
started yet are not run (they are recorded as capped, saying why).

Each worker process (``python -m polyamp.compare.converge SPEC OUT``) runs one job: the runs of
one (framework, policy, seed), every workload, appending one JSON line per run (MXNet's AMP is
process-wide: one policy per process suits it). ``run_all`` runs the jobs ``jobs`` at a time
(default: one per core), each limited to ``cores // jobs`` threads, longest expected first (so
that the cores finish together), and restarts a job whose process died with the runs it had left.
Jobs this small pack two cores to within about one run of the ideal, and a job costs one import.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import PolyampError
from . import interpreters, runner
from .workloads import WORKLOADS, get_workload

DEFAULT_SEEDS = 3
# the default cap of one run: nearly twice the slowest full-size run measured here (JAX float32 charlm,
# 170 core-seconds), far below torch fp16's charlm (about 35 min)
DEFAULT_BUDGET_S = 300.0
# evaluation cadence at full size: an evaluation costs about 1 step (digits) or 1.5-2.7 steps
# (charlm's 8 held-out batches, measured here), so evaluating stays at or under about 10 % of a run
EVERY = {"digits": 25, "charlm": 25}
QUICK_STEPS = 40  # a smoke run: tiny sizes, this many steps
PROJECT_AFTER = 5
PROJECT_MARGIN = 1.5
OK, CAPPED = "ok", "capped"
# core-seconds of one full-size charlm run of 400 steps, measured here (CPU time of 12 steps and 2
# evaluations, one thread; JAX uses two): their proportions order the jobs, nothing else
_COST = {("torch", "float32"): 115, ("torch", "bf16-mixed"): 75, ("torch", "fp16-mixed"): 35,
         ("jax", "float32"): 170, ("jax", "bf16-mixed"): 96, ("jax", "fp16-mixed"): 164,
         ("tensorflow", "float32"): 111, ("tensorflow", "bf16-mixed"): 80, ("tensorflow", "fp16-mixed"): 133,
         ("mxnet", "float32"): 142, ("mxnet", "bf16-mixed"): 108, ("mxnet", "fp16-mixed"): 1}  # fmt: skip


@dataclass
class Run:
    """One (framework, workload, policy, seed) run. ``status``: ok, capped, failed, unsupported,
    timeout or not installed; ``curve``: (step, held-out metric) pairs, None where not finite."""

    framework: str
    workload: str
    policy: str
    seed: int
    status: str = OK
    steps_requested: int = 0
    steps_run: int = 0
    curve: list[tuple[int, float | None]] = field(default_factory=list)
    steps_to_target: int | None = None
    final_metric: float | None = None
    skipped_steps: int = 0
    wall_s: float = 0.0
    cap_reason: str | None = None
    error: str | None = None
    worker_pid: int | None = None

    @property
    def case(self) -> tuple[str, str, str]:
        return self.framework, self.workload, self.policy

    @classmethod
    def from_json(cls, data: dict) -> Run:
        data = dict(data, curve=[tuple(point) for point in data.get("curve", [])])
        return cls(**data)


@dataclass(frozen=True)
class Plan:
    """What ``--converge`` runs: the cases, the seeds, and how."""

    frameworks: list[str]
    workloads: list[str]
    policies: list[str]
    seeds: int
    budget_s: float
    quick: bool = False
    steps: int | None = None  # None: each workload's target.max_steps (QUICK_STEPS with quick)

    def steps_for(self, workload: str) -> int:
        if self.steps is not None:
            return self.steps
        return QUICK_STEPS if self.quick else get_workload(workload).target.max_steps

    def every(self, workload: str) -> int:
        steps = self.steps_for(workload)
        full = EVERY.get(workload, 25)
        return full if steps >= get_workload(workload).target.max_steps else max(1, min(full, steps // 4))

    def runs(self) -> list[Run]:
        return [Run(f, w, p, s, steps_requested=self.steps_for(w)) for f in self.frameworks
                for w in self.workloads for p in self.policies for s in range(self.seeds)]  # fmt: skip


def target_workloads() -> list[str]:
    """The workloads with a convergence target, cheapest first."""
    having = [w for w in WORKLOADS if get_workload(w, quick=True).target is not None]
    return sorted(having, key=lambda w: w != "digits")


def make_plan(frameworks=None, workloads=None, policies=None, seeds=DEFAULT_SEEDS,
              budget_s=DEFAULT_BUDGET_S, quick=False, steps=None) -> Plan:  # fmt: skip
    """Check the options and name the cases (``runner.plan`` checks names and installations)."""
    having = target_workloads()
    for name in workloads or ():
        if name in WORKLOADS and name not in having:
            raise PolyampError(f"workload {name!r} has no convergence target; --converge accepts: "
                               f"{', '.join(having)}")  # fmt: skip
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise PolyampError(f"--seeds must be a whole number >= 1; got {seeds!r}")
    runner.check_options(steps, budget_s)
    cases = runner.plan(frameworks, workloads or having, policies)
    ordered = lambda items: list(dict.fromkeys(items))  # noqa: E731
    return Plan(ordered(c[0] for c in cases), ordered(c[1] for c in cases), ordered(c[2] for c in cases),
                seeds, float(budget_s), quick, steps)  # fmt: skip


# -- in the worker --------------------------------------------------------------------------------
def train(module, plan: Plan, run: Run, clock: Callable[[], float] = time.perf_counter) -> Run:
    """Train ``run`` with the trainer class of ``module`` (``Trainer(wl, policy)``); fills ``run``."""
    from .pairing import error_fields

    start = clock()
    every = plan.every(run.workload)

    def evaluate(step: int) -> None:
        value = trainer.evaluate()
        value = value if math.isfinite(value) else None
        run.curve.append((step, value))
        if run.steps_to_target is None and value is not None and wl.reached(value):
            run.steps_to_target = step

    try:
        wl = get_workload(run.workload, quick=plan.quick, steps=run.steps_requested, seed=run.seed)
        trainer = module.Trainer(wl, run.policy)
        evaluate(0)
        first = None  # elapsed at the end of the first step (which may compile)
        for i in range(wl.steps):
            trainer.step(i)
            run.steps_run = i + 1
            run.skipped_steps += not trainer.last.stepped
            if run.steps_run % every == 0 or run.steps_run == wl.steps:
                evaluate(run.steps_run)
            elapsed = clock() - start
            first = elapsed if first is None else first
            if run.steps_run < wl.steps:
                run.cap_reason = _cap(elapsed, first, run.steps_run, wl.steps, plan.budget_s)
                if run.cap_reason:
                    run.status = CAPPED
                    break
        if run.status == OK:
            run.final_metric = run.curve[-1][1]
    except Exception as err:
        fields = error_fields(err)
        run.status, run.error = fields["status"], fields["error"]
    run.wall_s = clock() - start
    return run


def _cap(elapsed: float, first: float, done: int, total: int, budget: float) -> str | None:
    """Why a run stops after ``done`` of ``total`` steps, or None to go on."""
    if elapsed > budget:
        return f"at step {done} of {total}: spent its {budget:g} s budget"
    if done > PROJECT_AFTER:
        projected = elapsed + (elapsed - first) / (done - 1) * (total - done)
        if projected > PROJECT_MARGIN * budget:
            return (f"at step {done} of {total}: its pace projects {projected:.0f} s, over "
                    f"{PROJECT_MARGIN:g}x its {budget:g} s budget")  # fmt: skip
    return None


def work(spec: dict, out: Path, load: Callable = importlib.import_module) -> None:
    """Run ``spec``'s runs in this process, appending each finished one to ``out`` (JSON lines);
    ``load`` imports a framework's trainer module by name."""
    plan = Plan(**spec["plan"])
    module = None
    for run in (Run.from_json(r) for r in spec["runs"]):
        run.worker_pid = os.getpid()
        try:
            module = module or load(f"polyamp.compare.{run.framework}")
        except Exception as err:
            run.status, run.error = "failed", f"{type(err).__name__}: {err}"
        else:
            train(module, plan, run)
        with open(out, "a", encoding="utf-8") as f:  # one whole line per run: the parent reads them
            f.write(json.dumps(asdict(run)) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m polyamp.compare.converge SPEC.json OUT.jsonl", file=sys.stderr)
        return 2
    work(json.loads(Path(argv[0]).read_text(encoding="utf-8")), Path(argv[1]))
    return 0


# -- in the parent --------------------------------------------------------------------------------
def jobs_of(plan: Plan) -> list[list[Run]]:
    """The runs of each worker process: one job per (framework, policy, seed), longest expected
    first, seed 0 of a case before its other seeds."""
    jobs: dict = {}
    for run in plan.runs():
        jobs.setdefault((run.framework, run.policy, run.seed), []).append(run)
    return [jobs[k] for k in sorted(jobs, key=lambda k: (-_COST.get(k[:2], 100), k[2]))]


def slots(plan: Plan, jobs: int | None = None) -> tuple[int, int]:
    """How many worker processes run at once (default: one per core) and how many threads each gets."""
    cores = os.cpu_count() or 1
    jobs = min(jobs or cores, max(1, len(jobs_of(plan))))
    return jobs, max(1, cores // jobs)


def thread_env(threads: int) -> dict:
    """Environment variables that hold each framework to ``threads`` compute threads."""
    n = str(threads)
    xla = os.environ.get("XLA_FLAGS", "")
    if threads == 1:
        xla += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
             "MXNET_CPU_WORKER_NTHREADS")  # fmt: skip
    return {**dict.fromkeys(names, n), "XLA_FLAGS": xla.strip()}


def run_all(plan: Plan, progress: Callable[[Run, bool], None] | None = None, jobs: int | None = None,
            timeout_s: float | None = None) -> list[Run]:  # fmt: skip
    """Every run of ``plan``, in ``plan.runs()`` order. ``progress(run, done)`` is called as a run
    starts (``done`` False) and as it ends. A framework not installed gets runs that say how to
    install it. A run without a record ``timeout_s`` after the one before (default: 1.5 budgets +
    2 min) is killed as ``timeout``; its process's later runs go on in a new process."""
    job_list = jobs_of(plan)
    jobs, threads = slots(plan, jobs)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3", **thread_env(threads)}
    timeout_s = timeout_s or PROJECT_MARGIN * plan.budget_s + 120
    lock = threading.Lock()
    capped: dict = {}  # case -> why its first capped seed was capped

    def notify(run: Run, done: bool) -> None:
        with lock:
            if done and run.status == CAPPED:
                capped.setdefault(run.case, f"seed {run.seed} was capped {run.cap_reason}")
            if progress:
                progress(run, done)

    def skip(run: Run, status: str, why: str) -> None:
        notify(run, False)
        run.status = status
        if status == CAPPED:
            run.cap_reason = why
        else:
            run.error = why
        notify(run, True)

    def run_job(runs: list[Run]) -> None:
        python = interpreters.interpreter(runs[0].framework)
        if python is None:
            for run in runs:
                skip(run, interpreters.NOT_INSTALLED, interpreters.HOW_TO_INSTALL[run.framework])
            return
        with lock:
            after = {r.case: capped[r.case] for r in runs if r.case in capped}
        for run in (r for r in runs if r.case in after):
            skip(run, CAPPED, f"not run: {after[run.case]}")
        left = [r for r in runs if r.case not in after]
        while left:
            left = left[_process(python, plan, left, env, timeout_s, notify) :]

    if jobs == 1:
        for runs in job_list:
            run_job(runs)
    else:
        with ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(run_job, runs) for runs in job_list]:
                future.result()
    return sorted((r for runs in job_list for r in runs), key=_order(plan))


def _order(plan: Plan) -> Callable[[Run], tuple]:
    def key(run: Run) -> tuple:
        return (plan.frameworks.index(run.framework), plan.workloads.index(run.workload),
                plan.policies.index(run.policy), run.seed)  # fmt: skip

    return key


def _process(python: str, plan: Plan, runs: list[Run], env: dict, timeout_s: float,
             notify: Callable[[Run, bool], None]) -> int:  # fmt: skip
    """Run ``runs`` in one worker process; fills them in place and returns how many got a result
    (when the process dies or times out, the run it was on is the last one counted)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out, log = Path(tmp) / "spec.json", Path(tmp) / "runs.jsonl", Path(tmp) / "log.txt"
        spec.write_text(json.dumps({"plan": asdict(plan), "runs": [asdict(r) for r in runs]}))
        with open(log, "w") as sink:
            proc = subprocess.Popen([python, "-m", "polyamp.compare.converge", str(spec), str(out)],
                                    stdout=sink, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        done, since = 0, time.perf_counter()
        notify(runs[0], False)
        try:
            while done < len(runs):
                exited = proc.poll() is not None
                for record in runner.read_records(out)[done:]:
                    runs[done].__dict__.update(vars(Run.from_json(record)))
                    notify(runs[done], True)
                    done, since = done + 1, time.perf_counter()
                    if done < len(runs):
                        notify(runs[done], False)
                if done == len(runs):
                    break
                if exited or time.perf_counter() - since > timeout_s:
                    run = runs[done]
                    if exited:
                        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                        run.status, run.error = "failed", f"exit code {proc.returncode}: " + " | ".join(tail)
                    else:
                        run.status, run.error = "timeout", f"no result within {timeout_s:g} s"
                    notify(run, True)
                    return done + 1
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return done


if __name__ == "__main__":
    sys.exit(main())
