"""Pair groups whose policies cannot share a process (MXNet), stepped in rounds from this process.

contrib.amp patches MXNet's operators for a whole process in one dtype, so each MXNet policy gets
its own ``worker --serve`` process. This process sends ``step`` to one at a time while the others
wait idle on their pipe, so the rounds interleave in time as they do in one process, and
``pairing.pair_group`` pairs them the same way, their inference calls too. What differs from
in-process pairing, and is labelled ``LOCKSTEP`` in the records: the policies run in separate
processes (their own caches, allocators and thread pools). A process that dies or passes the
timeout (per command) costs its policy's case in the current group; the next group starts a fresh
one.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ..timing import LOCKSTEP, CaseError
from .pairing import NOT_MEASURED, pair_group, pair_groups
from .workloads import get_workload


class Served:
    """One ``worker --serve`` process: ``call`` sends a command and waits for its reply."""

    def __init__(self, python: str, env: dict, log: Path):
        self.log = log
        with open(log, "w") as sink:
            command = [python, "-m", "polyamp.compare.worker", "--serve"]
            self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=sink)  # fmt: skip
        self.cases = 0  # built in this process so far

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, timeout: float, **command) -> dict:
        """The reply to ``command``; raises CaseError when the process died, timed out or the command
        raised there."""
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
            ready = select.select([self.proc.stdout], [], [], timeout)[0]
        except (BrokenPipeError, OSError):
            ready = [self.proc.stdout]  # died: readline gives EOF
        if not ready:
            self.proc.kill()
            raise CaseError("timeout", f"no result within the {timeout:g} s timeout of a case")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise CaseError("failed", f"exit code {code}: " + " | ".join(tail))
        reply = json.loads(line)
        if "failure" in reply:
            f = reply["failure"]
            raise CaseError(f["status"], f["error"], f["traceback"])
        return reply

    def close(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()


class RemoteRun:
    """A policy in its own process, seen as ``pairing.pair_group`` sees a local one."""

    def __init__(self, served: Served, timeout: float):
        self.served, self.timeout = served, timeout

    def step(self, i: int) -> float:
        return self.served.call(self.timeout, op="step", i=i)["seconds"]

    def result(self, evaluate: bool) -> dict:
        return self.served.call(self.timeout, op="result", evaluate=evaluate)

    def memory(self) -> dict:
        return self.served.call(self.timeout, op="memory")

    def inference_info(self) -> dict:
        return self.served.call(self.timeout, op="inference_info")

    def infer(self, k: int) -> float:
        return self.served.call(self.timeout, op="infer", k=k)["seconds"]

    def infer_eval(self) -> dict:
        return self.served.call(self.timeout, op="infer_eval")


class Pool:
    """The persistent process of each policy, started afresh when it is not alive."""

    def __init__(self, python: str, env: dict, tmp: Path):
        self.python, self.env, self.tmp = python, env, tmp
        self.served: dict[str, Served] = {}
        self.started = 0

    def get(self, policy: str) -> Served:
        if policy not in self.served or not self.served[policy].alive():
            self.started += 1
            self.served[policy] = Served(self.python, self.env, self.tmp / f"{policy}-{self.started}.log")
        return self.served[policy]

    def close(self) -> None:
        for proc in self.served.values():
            proc.close()


def run_lockstep(cases: list, python: str, env: dict, tmp: Path, quick: bool, steps, budget: float,
                 timeout: float, notify: Callable, roofline: bool = False,
                 infer_budget: float | None = None) -> dict | None:  # fmt: skip
    """Run ``cases`` (one framework) in pair groups, one process per policy kept across groups;
    ``notify(k, None)`` as case k starts and ``notify(k, record)`` as it ends. Returns the roofline
    measured in the first process (before it built anything) when ``roofline``."""
    framework = cases[0][0]
    pool = Pool(python, env, tmp)
    measured = None
    try:
        for group in pair_groups(cases):
            for k in group:
                notify(k, None)
            if roofline and measured is None:
                measured = roofline_of(pool.get(cases[group[0]][2]), framework, quick, timeout)
            for k, record in _group(pool, cases, group, quick, steps, budget, timeout, infer_budget):
                notify(k, record)
    finally:
        pool.close()
    return measured


def _group(pool: Pool, cases: list, group: list[int], quick: bool, steps, budget: float, timeout: float,
           infer_budget: float | None = None):  # fmt: skip
    """The (index, record) of each case of one pair group."""
    framework, workload = cases[group[0]][:2]
    policies = [cases[k][2] for k in group]
    start, load = time.perf_counter(), os.getloadavg()[0]
    runs, fields, info = {}, {}, {}
    for policy in policies:
        proc = pool.get(policy)
        info[policy] = {"worker_pid": proc.proc.pid, "process_case": proc.cases}
        proc.cases += 1
        try:
            built = proc.call(timeout, op="build", framework=framework, workload=workload, policy=policy,
                              quick=quick, steps=steps, seed=0)  # fmt: skip
        except CaseError as err:
            fields[policy] = {"status": err.status, "error": err.error, "traceback": err.remote_traceback,
                              **NOT_MEASURED}  # fmt: skip
            continue
        versions = built["versions"]
        info[policy].update(versions=versions, framework_version=versions.get(framework))
        runs[policy] = RemoteRun(proc, timeout)
    requested = get_workload(workload, quick=quick, steps=steps).steps
    fields.update(pair_group(runs, requested, budget, quick, LOCKSTEP, infer_budget))
    wall = time.perf_counter() - start
    for k, policy in zip(group, policies):
        record = {"framework": framework, "workload": workload, "policy": policy, "seed": 0,
                  "steps_requested": requested, "group_policies": policies,
                  "loadavg_1min": [load, os.getloadavg()[0]]}  # fmt: skip
        yield k, {**record, **info[policy], **fields[policy], "wall_s": wall}


def roofline_of(proc: Served, framework: str, quick: bool, timeout: float) -> dict:
    try:
        return proc.call(timeout, op="roofline", framework=framework, quick=quick)["roofline"]
    except CaseError as err:  # not a case's failure: the roofline says what happened
        return {"framework": framework, "gflops": {}, "size": {}, "errors": {"all": err.error}}
