import importlib.util
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers share the cores: torch, MXNet (OpenMP) and TensorFlow compute on one thread per
    # worker (and so do the processes a test starts), as two workers' full-width OpenMP pools spin against
    # each other. XLA keeps its threads: its single-threaded CPU path multiplies bf16 dots in float32,
    # which tests/test_jax_autocast.py checks it does not. A test that needs more threads sets them itself.
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
        os.environ.setdefault(_name, "1")

settings.register_profile("polyamp", max_examples=300, deadline=None)
settings.load_profile("polyamp")

# polyamp format name -> the ml_dtypes (or numpy) type with the same semantics, for cross-checks.
ML_DTYPES = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e2m3fn": ml_dtypes.float6_e2m3fn,
    "e3m2fn": ml_dtypes.float6_e3m2fn,
    "e2m1fn": ml_dtypes.float4_e2m1fn,
    "e8m0fnu": ml_dtypes.float8_e8m0fnu,
}


@pytest.fixture(params=["numba", "numpy"])
def implementation(request, monkeypatch):
    """Run a test against the compiled kernel and against the numpy path."""
    from polyamp.numerics import rounding

    if request.param == "numpy":
        monkeypatch.setenv("POLYAMP_NO_NUMBA", "1")
    rounding._kernel.cache_clear()
    if request.param == "numba" and rounding.backend() != "numba":
        # .venv-mxnet (numpy 1.23) has no numba; the Makefile sets POLYAMP_REQUIRE_NUMBA=1 for .venv
        if importlib.util.find_spec("numba") is None and os.environ.get("POLYAMP_REQUIRE_NUMBA") != "1":
            pytest.skip("numba is not installed in this environment (POLYAMP_REQUIRE_NUMBA=1 fails instead)")
        pytest.fail("numba is installed by the Makefile but the compiled kernel did not load")
    yield request.param
    monkeypatch.delenv("POLYAMP_NO_NUMBA", raising=False)
    rounding._kernel.cache_clear()
