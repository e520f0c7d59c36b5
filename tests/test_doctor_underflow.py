"""The doctor's fp16 underflow prediction against a real fp16 JAX step: benchmarks/doctor_underflow_jax.py
at its quick sizes; every layer within 2 points, on a model where gradients do flush."""

import importlib.util
from pathlib import Path

import pytest
from frameworks import require

require("jax")

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "doctor_underflow_jax.py"


@pytest.fixture(scope="module")
def underflow():
    spec = importlib.util.spec_from_file_location("doctor_underflow_jax", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_predicted_flush_matches_a_real_fp16_step_per_layer(underflow):
    res = underflow.check("deep_mlp", underflow.deep_mlp, quick=True)
    assert res["holds"], res
    assert max(r["predicted"] for r in res["rows"]) > 0.01  # gradients do flush: the check can fail
    assert max(r["observed"] for r in res["rows"]) > 0.01
    assert all(abs(r["gap"]) <= underflow.TOLERANCE for r in res["rows"])
