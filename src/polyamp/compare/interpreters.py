"""Which Python runs each framework's cases, how to install a missing one, and the machine's facts.

MXNet 1.9 needs numpy < 1.24 and lives in its own environment (``mxnet_python``); the others run in
this interpreter when they import. Shared by ``polyamp compare`` and the doctor's and tune's commands.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from ..errors import PolyampError

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet")
# the project's own MXNet environment (``make venv-mxnet``), for a source checkout
PROJECT_MXNET_PYTHON = Path(__file__).resolve().parents[3] / ".venv-mxnet" / "bin" / "python"
NOT_INSTALLED = "not installed"
HOW_TO_INSTALL = {
    "torch": "pip install torch==2.13.0 'polyamp[torch]' (or make venv in a checkout)",
    "tensorflow": "pip install 'polyamp[tensorflow]' (or make venv in a checkout)",
    "jax": "pip install 'polyamp[jax]' (or make venv in a checkout)",
    "mxnet": "MXNet 1.9 needs numpy<1.24, so its own environment: make venv-mxnet in a checkout (or "
    "python3.11 -m venv .venv-mxnet && .venv-mxnet/bin/pip install 'polyamp[mxnet]' 'numpy<1.24'), "
    "then pass --mxnet-python PATH or set POLYAMP_MXNET_PYTHON",
}


def mxnet_python() -> Path | None:
    """The Python that runs MXNet's cases: ``POLYAMP_MXNET_PYTHON`` (``--mxnet-python`` sets it),
    else the project's ``.venv-mxnet`` (next to its pyproject.toml), else ``./.venv-mxnet``."""
    given = os.environ.get("POLYAMP_MXNET_PYTHON")
    if given:
        if not Path(given).exists():
            raise PolyampError(f"the MXNet interpreter {given!r} (--mxnet-python / POLYAMP_MXNET_PYTHON) "
                               "does not exist")  # fmt: skip
        return Path(given)
    for path in (PROJECT_MXNET_PYTHON, Path(".venv-mxnet/bin/python")):
        if path.exists():
            return path
    return None


def interpreter(framework: str) -> str | None:
    """The Python that runs a framework's cases, or None where the framework is not installed.

    MXNet needs numpy < 1.24 and lives in its own environment (``mxnet_python``)."""
    if not has_module(f"polyamp.compare.{framework}"):
        return None
    if framework == "mxnet":
        path = mxnet_python()
        return str(path) if path is not None else None
    return sys.executable if has_module(framework) else None


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def installed_frameworks() -> list[str]:
    return [f for f in FRAMEWORKS if interpreter(f)]


def check_framework(name) -> None:
    if name not in FRAMEWORKS:
        raise PolyampError(f"unknown framework {name!r}; accepted: {', '.join(FRAMEWORKS)}")
    if interpreter(name) is None:
        raise PolyampError(f"{name} is not installed here ({HOW_TO_INSTALL[name]}); installed: "
                           f"{', '.join(installed_frameworks()) or 'none'}")  # fmt: skip


def child_env() -> dict:
    """The environment of a worker process: this one's, with the frameworks' warnings and logs off."""
    return {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}


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
