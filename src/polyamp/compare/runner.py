"""Plans the (framework, workload, policy) cases and runs each in its own subprocess.

A fresh process per case keeps peak memory and thread pools clean. A case that crashes or runs
past ``timeout`` is recorded with its error text and the run goes on. float32 runs first for
each (framework, workload): it is the baseline every other policy is compared with.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import PolyampError
from .workloads import WORKLOADS

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet")
DEFAULT_POLICIES = ("float32", "bf16-mixed", "fp16-mixed")
MXNET_PYTHON = Path(".venv-mxnet/bin/python")


def interpreter(framework: str) -> str | None:
    """The Python that runs a framework's cases, or None where the framework is not installed.

    MXNet needs numpy < 1.24 and lives in its own environment (``.venv-mxnet``)."""
    if not _has_module(f"polyamp.compare.{framework}"):
        return None
    if framework == "mxnet":
        path = Path(os.environ.get("POLYAMP_MXNET_PYTHON", MXNET_PYTHON))
        return str(path) if path.exists() else None
    return sys.executable if _has_module(framework) else None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def installed_frameworks() -> list[str]:
    return [f for f in FRAMEWORKS if interpreter(f)]


def plan(frameworks=None, workloads=None, policies=None) -> list[tuple[str, str, str]]:
    """The cases to run, float32 first within each (framework, workload)."""
    frameworks = list(frameworks or installed_frameworks())
    for name in frameworks:
        if name not in FRAMEWORKS:
            raise PolyampError(f"unknown framework {name!r}; accepted: {', '.join(FRAMEWORKS)}")
        if interpreter(name) is None:
            raise PolyampError(
                f"{name} is not installed here; installed: {', '.join(installed_frameworks())}"
            )
    workloads = list(workloads or WORKLOADS)
    for name in workloads:
        if name not in WORKLOADS:
            raise PolyampError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    from ..policy import Policy

    policies = [Policy.parse(p).name for p in (policies or DEFAULT_POLICIES)]
    policies.sort(key=lambda p: p != "float32")
    return [(f, w, p) for f in frameworks for w in workloads for p in policies]


def run_case(case, quick: bool, steps: int | None, budget: float, timeout: float) -> dict:
    """Run one case in a subprocess; a crash or a timeout becomes a record with the error."""
    framework, workload, policy = case
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [interpreter(framework), "-m", "polyamp.compare.worker", "--framework", framework,
               "--workload", workload, "--policy", policy, "--budget", str(budget),
               "--out", str(out)]  # fmt: skip
        if quick:
            cmd.append("--quick")
        if steps is not None:
            cmd += ["--steps", str(steps)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return _error_record(case, "timeout", f"no result within the {timeout:g} s timeout of a case")
        if out.exists():
            record = json.loads(out.read_text())
            record.setdefault("wall_s", time.perf_counter() - start)
            return record
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        return _error_record(case, "failed", f"exit code {proc.returncode}: " + " | ".join(tail))


def _error_record(case, status: str, error: str) -> dict:
    framework, workload, policy = case
    return {"framework": framework, "workload": workload, "policy": policy, "status": status,
            "error": error}  # fmt: skip


def run(cases, quick=False, steps=None, budget=6.0, timeout=300.0, progress: Callable | None = None):
    """Run every case in order; ``progress(i, case, record)`` is called after each."""
    records = []
    for i, case in enumerate(cases):
        if progress:
            progress(i, case, None)
        record = run_case(case, quick, steps, budget, timeout)
        records.append(record)
        if progress:
            progress(i, case, record)
    return records


def machine() -> dict:
    """Facts about where the run happened, for the report."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}  # fmt: skip
