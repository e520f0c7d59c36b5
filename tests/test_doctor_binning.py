"""Every front end's binning (``histogram``, ``ratio_histogram``) equals the numpy core bit for bit on the
same edge cases: written once, run on each installed framework and each of its binning paths (torch: its
ops, the compiled kernel, an accelerator's ops; MXNet: numpy on host memory, MXNet's ops). The framework
is imported with ``frameworks.require`` semantics; this file runs in ``.venv`` and in ``.venv-mxnet``."""

import math
import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from frameworks import require  # noqa: E402

from polyamp import PolyampError  # noqa: E402
from polyamp.doctor import LogHistogram, update_ratio_histogram  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16,
      "float64": np.dtype(np.float64)}  # fmt: skip
# each framework's binning paths, and the dtypes its tests here bin (JAX's float64 needs x64: test_doctor_jax)
PATHS = {"torch": ["torch ops", "compiled", "device ops"], "tensorflow": ["default"], "jax": ["default"],
         "mxnet": ["numpy", "mxnet"]}  # fmt: skip
DTYPES = {"jax": ["float32", "float16", "bfloat16"]}
RUNS = [(fw, path) for fw, paths in PATHS.items() for path in paths]
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")


class Binning:
    """One framework on one path: ``array(a)`` makes its array of the numpy array ``a``, whose values
    ``values(array)`` gives back (``a`` itself but where MXNet's bfloat16 cast flushes subnormals);
    ``histogram`` and ``ratio_histogram`` are its front end's."""

    def __init__(self, name: str, path: str, monkeypatch):
        self.name = name
        self.values = None
        getattr(self, "_" + name)(path, monkeypatch)

    def reference(self, a, array) -> LogHistogram:
        return LogHistogram.of(a if self.values is None else self.values(array))

    def _torch(self, path, monkeypatch):
        torch = require("torch")
        from polyamp.torch import binning, binning_device

        if path == "torch ops":
            monkeypatch.setattr(binning, "_COMPILED_MIN", 1 << 62)
        elif path == "device ops":
            monkeypatch.setattr(binning_device, "on_accelerator", lambda x: True)
        else:
            if binning._kernel_module() is None:
                if os.environ.get("POLYAMP_REQUIRE_NUMBA") == "1":
                    pytest.fail("numba is installed by the Makefile but the binning kernel did not load")
                pytest.skip("numba is not installed in this environment")
            monkeypatch.setattr(binning, "_COMPILED_MIN", 1)
        self.histogram, self.ratio_histogram = binning.histogram, binning.ratio_histogram

        def array(a):
            if a.dtype == BF16:
                return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
            return torch.from_numpy(np.array(a))

        self.array, self.transposed = array, lambda a: array(a).t()

    def _tensorflow(self, path, monkeypatch):
        tf = require("tensorflow")
        from polyamp.tensorflow.doctor import histogram, ratio_histogram

        self.histogram, self.ratio_histogram = histogram, ratio_histogram
        self.array = tf.constant
        self.transposed = lambda a: tf.Variable(tf.transpose(tf.constant(a)))  # a variable, transposed

    def _jax(self, path, monkeypatch):
        jax = require("jax")
        from polyamp.jax.doctor import histogram, ratio_histogram

        self.histogram, self.ratio_histogram = histogram, ratio_histogram
        self.array = jax.numpy.asarray
        self.transposed = lambda a: jax.numpy.asarray(a).T

    def _mxnet(self, path, monkeypatch):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            mx = require("mxnet")
        from mxnet.contrib.amp.amp import bfloat16

        from polyamp.mxnet import binning
        from polyamp.mxnet.doctor import histogram, ratio_histogram

        if path == "mxnet":  # no context counted as host memory, as on a GPU
            monkeypatch.setattr(binning, "_HOST_DEVICES", frozenset())
        self.histogram, self.ratio_histogram = histogram, ratio_histogram

        def array(a):
            if a.dtype == BF16:
                return mx.nd.amp_cast(mx.nd.array(a.astype(np.float32)), dtype=bfloat16)
            return mx.nd.array(a, dtype=a.dtype.name)

        def values(x):
            if np.dtype(x.dtype).names == ("bfloat16",):
                return x.astype("float32").asnumpy().astype(ml_dtypes.bfloat16)
            return x.asnumpy()

        self.array, self.values = array, values
        self.transposed = None  # MXNet: slices and reshapes in test_doctor_mxnet


@pytest.fixture(params=RUNS, ids=[f"{fw}-{path}" for fw, path in RUNS])
def fw(request, monkeypatch):
    return Binning(*request.param, monkeypatch)


def dtypes_of(fw: Binning, wanted):
    return [d for d in wanted if d in DTYPES.get(fw.name, wanted)]


def special_values(dtype: str) -> np.ndarray:
    info = ml_dtypes.finfo(NP[dtype])
    big, tiny = float(info.max), float(info.smallest_normal)
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, big, -big, tiny, tiny / 2, tiny / 8, -tiny / 1024]
    if dtype in ("float32", "float64"):
        values += [1e-45, -3e-44, 1.17e-38] if dtype == "float32" else [5e-324, 1e-310]
    return np.array(values, np.float64).astype(NP[dtype])


def wide(n: int, dtype: str, seed: int) -> np.ndarray:
    """Random magnitudes over most of the dtype's exponent range (subnormals included), both signs."""
    rng = np.random.default_rng(seed)
    info = ml_dtypes.finfo(NP[dtype])
    e = rng.uniform(math.log2(float(info.smallest_normal)) - 8, math.log2(float(info.max)) - 1, n)
    return (np.sign(rng.standard_normal(n)) * np.exp2(e)).astype(NP[dtype])


# -- histograms ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(NP))
def test_histogram_equals_the_numpy_core(fw, dtype):
    if dtype not in dtypes_of(fw, NP):
        pytest.skip(f"{fw.name} bins {dtype} in its own file")
    rng = np.random.default_rng(0)
    x = wide(20000, dtype, seed=1)
    with_specials = x.copy()
    with_specials[::97] = np.resize(special_values(dtype), with_specials[::97].size)
    np_dtype = NP[dtype]
    cases = [
        x,
        with_specials,
        rng.standard_normal((3, 5, 7)).astype(np_dtype),  # a few elements, not flat
        (rng.standard_normal(20000) * 1e-3).astype(np_dtype),  # x's shape: the same compiled program
        special_values(dtype),
        np.zeros(4, np_dtype),  # the small cases of one shape: one compiled program
        np.full(4, np.nan, np_dtype),
        np.array([0.0, np.inf, -0.0, -np.inf], np_dtype),
        np.array([0.0, np.inf, -0.0], np_dtype),
        np.zeros(9, np_dtype),
    ]
    if fw.name != "mxnet":
        cases.append(np.empty(0, np_dtype))
    for a in cases:
        arr = fw.array(a)
        assert fw.histogram(arr) == fw.reference(a, arr), (fw.name, dtype, a.ravel()[:8])
    if fw.transposed is not None:  # not contiguous
        t = rng.standard_normal((64, 48)).astype(np_dtype)
        assert fw.histogram(fw.transposed(t)) == LogHistogram.of(np.ascontiguousarray(t.T))


def test_float32_subnormals_zeros_and_extremes_are_binned_exactly(fw):
    """XLA on CPU and TensorFlow treat subnormals as zero in float arithmetic: the binning must not."""
    sub = np.array([1e-45, 2.8e-45, 1e-40, -1.1e-38, 5e-39, 0.0, -0.0], np.float32)
    h = fw.histogram(fw.array(sub))
    assert h == LogHistogram.of(sub)
    assert h.zeros == 2 and h.amin_nonzero == float(np.float32(1e-45))
    assert h.amax == float(np.float32(1.1e-38))
    assert fw.histogram(fw.array(np.array([math.nan, 0.0], np.float32))).amin_nonzero is None
    assert fw.histogram(fw.array(np.array([math.inf, 2.0, -3.0], np.float32))).amax == 3.0
    mixed = np.array([3.0, 1e-40, 0.5], np.float32)  # a normal maximum, a subnormal minimum
    assert fw.histogram(fw.array(mixed)) == LogHistogram.of(mixed)
    assert fw.histogram(fw.array(mixed)).amin_nonzero == float(np.float32(1e-40))


# -- update ratios ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, n", [("float32", 6000), ("float64", 6000), ("float16", 6000),
                                      ("float32", 20000), ("float32", (1 << 18) + 4097)])  # fmt: skip
def test_update_ratio_histogram_equals_the_numpy_core(fw, dtype, n):
    """TensorFlow: small tensors take the general kernel, larger float32 ones the XLA kernel (one chunk;
    chunks, the last one shifted back over elements the one before counted)."""
    if dtype not in dtypes_of(fw, NP):
        pytest.skip(f"{fw.name} bins {dtype} in its own file")
    rng = np.random.default_rng(2)
    w = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(np.float32)
    u = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 10, n))).astype(np.float32)
    with np.errstate(over="ignore"):
        w, u = w.astype(NP[dtype]), u.astype(NP[dtype])

    def check(u, w):
        got, want = fw.ratio_histogram(fw.array(u), fw.array(w)), update_ratio_histogram(u, w)
        assert got == want
        return got

    check(u, w)
    u[5] = 0  # one lost update (u == 0) in a large tensor, then every kind of special element
    assert check(u, w).zeros >= 1
    specials = {0: (0.0, 1.0), 7: (1.0, 0.0), 11: (math.nan, 1.0), 13: (1.0, math.inf), 17: (0.0, 0.0),
                19: (1e-44, 1.0), 23: (1.0, 1e-41), 29: (3e38, 1e-37), 31: (1e-37, 3e38),
                n - 1: (1e-37, 3e38), n - 2: (0.0, 2.0), n - 4096: (math.inf, 1.0)}  # fmt: skip
    with np.errstate(over="ignore"):
        for i, (ui, wi) in specials.items():
            u[i], w[i] = ui, wi
    got = check(u, w)
    want = update_ratio_histogram(u, w)
    assert got.apart == want.apart >= 1 and got.nonfinite >= 2
    if dtype == "float32":  # ratios beyond float32's range, both ways: float64 extremes, exactly
        assert got.amax > 2.0**128 and got.amin_nonzero < 2.0**-149
        check(np.array([1e-45, 3e38], np.float32), np.array([3e38, 1e-45], np.float32))
    zeros, ones = np.zeros(4, NP[dtype]), np.ones(4, NP[dtype])
    assert fw.ratio_histogram(fw.array(zeros), fw.array(ones)).zeros == 4
    assert fw.ratio_histogram(fw.array(zeros[:0]), fw.array(zeros[:0])).total == 0
    with pytest.raises(PolyampError, match="shape"):
        fw.ratio_histogram(fw.array(u[:3]), fw.array(w[:4]))
