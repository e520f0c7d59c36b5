"""Importing the frameworks a test compares against, as the test run asked.

``POLYAMP_TEST_FRAMEWORKS`` (set by the Makefile) names the frameworks a run must cover: a test
needing one of those fails when it cannot be imported; any other missing framework is a skip
(e.g. torch inside ``.venv-mxnet``, MXNet inside ``.venv``).
"""

import importlib
import os

import pytest

# a module -> the framework whose requested run must have it (the model libraries of the real-model
# tests are installed by the Makefile with their framework; timm, in an environment of its own, is
# requested by name: POLYAMP_TEST_FRAMEWORKS=torch,timm)
_REQUESTED_AS = {"keras": "tensorflow", "keras_hub": "tensorflow", "transformers": "torch", "flax": "jax",
                 "equinox": "jax", "lightning": "torch", "accelerate": "torch"}


# what a polyamp record's error says where MXNet computes no bf16 (a CPU without AVX-512:
# polyamp/mxnet/capability.py); such a case is reported "unsupported", a hardware capability like CUDA
MXNET_NO_BF16 = "computes no bfloat16 on this CPU"


def mxnet_bf16_refused(record: dict) -> bool:
    """An MXNet record polyamp refused because this CPU computes no bf16 in MXNet."""
    return record.get("status") == "unsupported" and MXNET_NO_BF16 in (record.get("error") or "")


def requested(name: str) -> bool:
    wanted = [n for n in os.environ.get("POLYAMP_TEST_FRAMEWORKS", "").split(",") if n]
    return _REQUESTED_AS.get(name, name) in wanted


def require(name: str):
    """The imported module ``name``: an ImportError (a failure) where the run requested it,
    otherwise a skip where it is not installed."""
    if requested(name):
        return importlib.import_module(name)
    return pytest.importorskip(name)
