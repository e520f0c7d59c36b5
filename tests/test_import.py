"""``import polyamp`` pulls in no framework, and every framework this run covers is importable."""

import importlib
import os
import subprocess
import sys

import pytest

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet", "keras", "jmp")


CORE_MODULES = ["polyamp, polyamp.numerics", "polyamp.policy, polyamp.scaling", "polyamp.native",
                "polyamp.mixed_precision, polyamp.eager, polyamp.frameworks", "polyamp.doctor"]  # fmt: skip


@pytest.mark.parametrize("modules", CORE_MODULES)
def test_import_polyamp_imports_no_framework(modules):
    code = (
        f"import sys, {modules};"
        "import polyamp; polyamp.quantize([1.0], 'e4m3fn');"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def requested_frameworks():
    names = os.environ.get("POLYAMP_TEST_FRAMEWORKS", "")
    return [n for n in names.split(",") if n]


@pytest.mark.parametrize("name", requested_frameworks() or ["(none requested)"])
def test_requested_frameworks_are_installed(name):
    """A framework the run was asked to cover must import: a failure, never a skip."""
    if name == "(none requested)":
        assert "POLYAMP_TEST_FRAMEWORKS" not in os.environ or not requested_frameworks()
        return
    module = importlib.import_module(name)
    assert module.__name__ == name
