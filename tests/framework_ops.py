"""One small adapter per framework, for tests written once and run on every installed framework.

An adapter knows only its framework's vocabulary: numpy in and out bit for bit (bfloat16 and NaN signs
included), its tensor type, its integer tensors and what refusing them says, its compilers
(``torch.compile``, ``tf.function``, ``jax.jit``), the scope that float64 needs (JAX's ``enable_x64``)
and whether it compiles each new shape and static argument (JAX: its tests then take a covering subset
of a grid). ``adapter(name)`` imports the framework through ``frameworks.require``: a requested
framework that cannot be imported fails, any other is a skip.
"""

import contextlib
import warnings

import ml_dtypes
import numpy as np
from frameworks import require

BF16 = np.dtype(ml_dtypes.bfloat16)


class Torch:
    name = module_root = "torch"
    compiles_each_shape = False
    compiler_names = ("torch.compile",)
    has_scalars = True
    refusal = "expected a floating-point tensor, got dtype torch"
    keeps_nan_sign = False  # the core's contract leaves a NaN's sign free; torch's (and MXNet's) ops differ

    def __init__(self):
        self.torch = torch = require("torch")
        self.tensor_type = torch.Tensor
        self.compilers = {"torch.compile": lambda f, _: torch.compile(f, backend="eager", fullgraph=True)}

    def tensor(self, a):
        a = np.asarray(a)
        if a.dtype == BF16:  # numpy cannot hand bfloat16 to torch: go through the bits
            return self.torch.from_numpy(a.view(np.int16).copy()).view(self.torch.bfloat16)
        return self.torch.from_numpy(a.copy(order="C"))

    def numpy(self, t):
        t = t.detach().cpu()
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(BF16)
        return t.numpy()

    def ints(self, n):
        return self.torch.ones(n, dtype=self.torch.int32)

    def holding(self, dtype):
        return contextlib.nullcontext()


class TensorFlow:
    name = module_root = "tensorflow"
    compiles_each_shape = False
    compiler_names = ("tf.function", "jit_compile")
    has_scalars = True
    refusal = "expected a floating-point tensor, got dtype int32"
    keeps_nan_sign = True

    def __init__(self):
        self.tf = tf = require("tensorflow")
        self.tensor_type = tf.Tensor
        # without XLA as ``graph_call`` traces the recipes' kernels (no AutoGraph: its conversion is most
        # of a trace); under XLA as a user writes it where asked (AutoGraph converting polyamp's code)
        self.compilers = {"tf.function": lambda f, _: tf.function(f, autograph=False),
                          "jit_compile": lambda f, ag: tf.function(f, jit_compile=True, autograph=ag)}

    def tensor(self, a):
        """``a`` as a TF tensor, bit for bit (a cast to bfloat16 would drop NaN signs)."""
        a = np.asarray(a)
        if a.dtype == BF16:
            return self.tf.bitcast(self.tf.constant(a.view(np.uint16)), self.tf.bfloat16)
        return self.tf.constant(a)

    def numpy(self, t):
        return t.numpy()

    def ints(self, n):
        return self.tf.ones(n, self.tf.int32)

    def holding(self, dtype):
        return contextlib.nullcontext()


class Jax:
    name = module_root = "jax"
    compiles_each_shape = True
    compiler_names = ("jax.jit",)
    has_scalars = True
    refusal = "expected a floating-point array"
    keeps_nan_sign = True

    def __init__(self):
        self.jax = jax = require("jax")
        import jax.numpy as jnp

        self.jnp = jnp
        self.tensor_type = jax.Array
        self.compilers = {"jax.jit": lambda f, _: jax.jit(f)}

    def tensor(self, a):
        a = np.asarray(a)
        t = self.jnp.asarray(a)
        assert t.dtype == a.dtype, f"{a.dtype} needs fw.holding(np.float64) in JAX"
        return t

    def numpy(self, t):
        return np.asarray(t)

    def ints(self, n):
        return self.jnp.ones(n, self.jnp.int32)

    def holding(self, dtype):
        """float64 arrays exist only inside ``jax.enable_x64``."""
        return self.jax.enable_x64(True) if np.dtype(dtype) == np.float64 else contextlib.nullcontext()


class MXNet:
    name = module_root = "mxnet"
    compiles_each_shape = False
    compiler_names = ()
    has_scalars = False  # no 0-d and no zero-size NDArrays
    refusal = "accepted: float16, bfloat16, float32, float64"
    keeps_nan_sign = False

    def __init__(self):
        with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
            warnings.simplefilter("ignore", DeprecationWarning)
            self.mx = mx = require("mxnet")
        from mxnet.contrib import amp

        self.bf16 = amp.amp.bfloat16
        self.tensor_type = mx.nd.NDArray
        self.compilers = {}

    def tensor(self, a):
        """``a`` as an NDArray, bit for bit (``cast``, not oneDNN's ``amp_cast``, which makes -0 +0 and
        flushes subnormals on a CPU without AVX-512)."""
        a = np.asarray(a)
        if a.dtype == BF16:
            return self.mx.nd.cast(self.mx.nd.array(a.astype(np.float32), dtype="float32"), dtype=self.bf16)
        return self.mx.nd.array(a, dtype=a.dtype.name)

    def ops_array(self, a):
        """``a`` as an array of ``polyamp.mxnet.xp`` (``mx.np``; the front end converts NDArrays)."""
        return self.mx.np.array(a, dtype=a.dtype.name)

    def numpy(self, t):
        a = t.asnumpy()
        if a.dtype.names == ("bfloat16",):  # MXNet hands bfloat16 out as a one-field record of 2 bytes
            return a.view(np.uint16).view(BF16)
        return a

    def ints(self, n):
        return self.mx.nd.ones(n, dtype="int32")

    def holding(self, dtype):
        return contextlib.nullcontext()


ADAPTERS = {a.name: a for a in (Torch, TensorFlow, Jax, MXNet)}
_MADE = {}


def adapter(name: str):
    """The adapter of framework ``name``, made once per process."""
    if name not in _MADE:
        _MADE[name] = ADAPTERS[name]()
    return _MADE[name]


def ops_array(fw, a):
    """``a`` as an array of the framework's ``xp`` ops module (its tensor, but ``mx.np`` in MXNet)."""
    return fw.ops_array(a) if hasattr(fw, "ops_array") else fw.tensor(a)


def same_bits(fw, got, want):
    """``got`` is ``fw``'s tensor with ``want``'s dtype, shape and bit pattern; NaNs need only agree in
    sign where the framework keeps it (payloads are not compared)."""
    assert isinstance(got, fw.tensor_type), type(got)
    got, want = fw.numpy(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    u = f"u{got.itemsize}"
    nan = np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
    if fw.keeps_nan_sign:
        nan &= np.signbit(got) == np.signbit(want)
    ok = (got.view(u) == want.view(u)) | nan
    bad = np.flatnonzero(~ok)[:5]
    assert ok.all(), f"{(~ok).sum()} differ, first at {bad}: got {got.flat[bad]}, want {want.flat[bad]}"
