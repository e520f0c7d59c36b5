"""mxnet's array primitives: the ops layer polyamp's framework-neutral algorithms run over.

Only mxnet's vocabulary lives here (as in Keras 3's ``keras/src/backend/<name>/``): each algorithm
(exact rounding and block formats, the doctor's binning, Hadamard tiles, the recipes' GEMM rule) is
written once in the core over the functions of a module like this one. ``polyamp.frameworks.ops_of``
finds this module from a mx.nd.NDArray (mx.np.ndarray is one).
"""

from __future__ import annotations

import math
import sys

import mxnet as mx
import numpy as np

from ..errors import PolyampError
from ..numerics import exact_float

NAME = "mxnet"


def accepts(x) -> bool:
    """Whether ``x`` is an array of this framework the core's algorithms take."""
    return isinstance(x, mx.nd.NDArray)


def round_to_format(x, fmt, mode, saturate, seed):
    """``polyamp.quantize`` on an MXNet NDArray, its arguments checked by the core (``fmt`` a FloatFormat,
    ``mode`` the rounding's code, ``seed`` an int or None): the float64 route, on ``x``'s context."""
    from ..numerics.rounding import _result_name

    v, name = _input(x, "quantize")
    out = exact_float.round_float64(sys.modules[__name__], v, fmt, mode, saturate, seed or 0)
    return _output(out, _result_name(name, fmt), x)


def round_to_blocks(x, bf, axes, shape, rule, mode, seed):
    """``polyamp.quantize_blocks`` on an MXNet NDArray, its arguments checked by the core (``bf`` a
    BlockFormat, ``axes`` / ``shape`` the blocked axes and block shape, ``rule`` the scale rule or None):
    the float64 route; it reads two per-block flags and, for float64 NVFP4, the global amax."""
    ops = sys.modules[__name__]
    x64, name = _input(x, "quantize_blocks")
    wide = name == "float64"
    elements, scales, g = exact_float.encode_blocks(ops, x64, bf, axes, shape, rule, mode, seed or 0, wide)
    values = exact_float.block_values(ops, axes, shape, elements, scales, g)
    return _output(values, "float64" if wide else "float32", x)


# -- rounding and block formats ------------------------------------------------------------------------
# the primitives of ``polyamp.numerics.exact_float`` (the float64 route), in ``mx.np`` ops (which
# contrib.amp does not patch). MXNet 1.9 has no bitcast and no shifts, its ``rint`` rounds a tie down
# and ``round`` away from zero, ``copysign`` ignores -0, and it hands a scalar operand to its kernels as a
# 16-digit decimal (``const``); full-size ``where`` is its slowest elementwise op.
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_U64 = 1 << 64


def const(value: float, like, dtype: str = "float64"):
    """``value`` as an operand next to ``like``: the number itself when it has a short decimal form,
    else a (1,) array (MXNet reads 2^-127 back as 5.877471754111439e-39, bf16's max as
    3.389531389251535e+38)."""
    if not isinstance(value, (int, float)):
        return value
    value = float(value)
    if not math.isfinite(value) or float(f"{value:.12g}") == value:
        return value
    return mx.np.array(np.array([value], dtype=dtype), ctx=like.ctx)


def size(v) -> int:
    return v.size


def abs(v):  # noqa: A001 - the ops vocabulary
    return mx.np.abs(v)


def spacing(a, lo: int, hi: int, mbits: int):
    """``(t, q)``: ``e`` = frexp's exponent of ``a`` minus one (``floor(log2 a)``, exact) clamped to
    ``[lo, hi]``, ``q = 2^(e - mbits)``, ``t = a / q`` (exact)."""
    _, e2 = mx.np.frexp(a)
    q = mx.np.power(2.0, mx.np.clip(e2.astype("float64") - 1.0, lo, hi) - mbits)
    return a / q, q


def rint(t):
    """``(t + 2^52) - 2^52``: ties to even for ``0 <= t < 2^52`` (a larger ``t`` overflows the format)."""
    return (t + 2.0**52) - 2.0**52


def floor(t):
    return mx.np.floor(t)


def minimum(a, b):
    return mx.np.minimum(a, const(b, a))  # keeps NaN


def maximum(a, b):
    return mx.np.maximum(a, const(b, a))


def where(cond, a, b):
    if not isinstance(a, mx.nd.NDArray) and not isinstance(b, mx.nd.NDArray):  # two short-decimal numbers
        b = mx.np.full(cond.shape, b, dtype="float64", ctx=cond.ctx)
    like = b if isinstance(b, mx.nd.NDArray) else a
    return mx.np.where(cond, const(a, like), const(b, like))


def isnan(v):
    return mx.np.isnan(v)


def isinf(v):
    return mx.np.isinf(v)


def isfinite(v):
    return mx.np.isfinite(v)


def keep_nan(r, a):
    """``r``, already NaN where ``a`` is (every step propagates it; no full-size ``where``)."""
    return r


def copysign(r, v):
    """``r`` (>= 0 or NaN) with ``v``'s sign, -0 included: times ``1 - 2 signbit(v)``."""
    return r * (1.0 - 2.0 * mx.np.signbit(v).astype("float64"))


def float64(v):
    return v.astype("float64")


def integer(flags):
    """Flags as 0 / 1 of the exponents' type (float64 integers here)."""
    return flags.astype("float64")


def clip(v, lo, hi):
    return mx.np.clip(v, lo, hi)


def exponent(a):
    """floor(log2 a) of finite ``a`` > 0 (frexp, exact), float64."""
    return mx.np.frexp(a)[1].astype("float64") - 1.0


def pow2(k):
    return mx.np.power(2.0, k)


def may_hold(flags) -> bool:
    """Whether any flag is set: one host read."""
    return bool(mx.np.max(flags.astype("float32"), keepdims=True).asnumpy().max() > 0)


def finite_max(a):
    """max of the finite elements of ``a`` >= 0 as a (1,) array."""
    return mx.np.max(mx.np.where(mx.np.isfinite(a), a, 0.0), keepdims=True).reshape((1,))


def item(v) -> float:
    return float(v.asnumpy().max())


def float32_round(v):
    return v.astype("float32").astype("float64")


def float32(v):
    return v.astype("float32")


def round_saturated(v, fmt, mode: int, seed: int, narrow: bool):
    return exact_float.round_float64(sys.modules[__name__], v, fmt, mode, True, seed)


def moveaxis(v, src, dst):
    return mx.np.moveaxis(v, src, dst)


def pad_end(v, widths):
    return mx.np.pad(v, tuple((0, w) for w in widths))


def reshape(v, shape):
    return v.reshape(tuple(shape))


def amax(v, axes):
    return mx.np.max(v, axis=axes)  # NaN wins


def repeat(v, b: int, axis: int, length: int):
    out = mx.np.repeat(v, b, axis=axis)
    return out if out.shape[axis] == length else out[(slice(None),) * axis + (slice(0, length),)]


def _int64(c: int, ctx):
    """A constant as a (1,) int64 array (MXNet passes a scalar operand as a double, which would round it)."""
    return mx.np.array(np.array([c - _U64 if c >= 1 << 63 else c], dtype=np.int64)).as_in_ctx(ctx)


def words(start: int, stop: int, like):
    return mx.np.arange(start, stop, dtype="int64", ctx=like.ctx)


def word(c: int, like):
    return _int64(c, like.ctx)


def xor(a, b):
    return mx.np.bitwise_xor(a, b)


def shr(z, s: int):
    """Logical right shift of int64 bit patterns: the low 63 bits divided by 2^s (a truncating integer
    division, exact on values >= 0), plus the sign bit's 2^(63 - s)."""
    low = mx.np.bitwise_and(z, _int64((1 << 63) - 1, z.ctx)).as_nd_ndarray()
    shifted = mx.nd.broadcast_div(low, _int64(1 << s, z.ctx).as_nd_ndarray()).as_np_ndarray()
    return shifted + (z < 0).astype("int64") * (1 << (63 - s))


def unit53(z):
    return shr(z, 11).astype("float64") * const(2.0**-53, z)


def _input(x, what: str):
    """``x`` as a float64 ``mx.np`` array (exact), and its dtype's name."""
    from .keep import dtype_name

    name = dtype_name(x.dtype)
    if name not in _FLOATS:
        raise PolyampError(
            f"expected a floating-point NDArray, got dtype {name}; accepted: {', '.join(_FLOATS)}"
        )
    if x.size == 0:
        raise PolyampError(f"{what} takes a non-empty NDArray (MXNet 1.9 has no zero-size arrays); got "
                           f"shape {x.shape}")  # fmt: skip
    return as_np(x).astype("float64"), name


def as_np(x):
    """An NDArray as an ``mx.np`` array (shared memory); bfloat16 widened to float32 (mx.np has no bf16)
    by ``Cast``, exact (oneDNN's ``amp_cast`` turns -0 into +0 on CPUs without AVX-512)."""
    from .keep import dtype_name

    if dtype_name(x.dtype) == "bfloat16":
        x = mx.nd.cast(x.as_nd_ndarray(), dtype="float32")
    return x if isinstance(x, mx.np.ndarray) else x.as_np_ndarray()


def _output(v, name: str, like):
    """``v`` in dtype ``name`` as the kind of array ``like`` is (an NDArray, or an ``mx.np`` array).

    A bfloat16 result holds bf16 values already, which ``Cast`` (it truncates) keeps bit for bit;
    oneDNN's ``amp_cast`` (it rounds) flushes subnormals and turns -0 into +0 on CPUs without AVX-512."""
    if name == "bfloat16":
        from mxnet.contrib import amp

        out = mx.nd.cast(v.astype("float32").as_nd_ndarray(), dtype=amp.amp.bfloat16)
    else:
        out = v.astype(name).as_nd_ndarray()
    return out.as_np_ndarray() if isinstance(like, mx.np.ndarray) else out




# -- binning (the doctor) ------------------------------------------------------------------------------


# -- Hadamard tiles and the recipes' GEMM rule ---------------------------------------------------------
def tensor_facts(x) -> tuple[str, tuple]:
    """``x``'s dtype name (bfloat16 included) and shape."""
    from .keep import dtype_name

    return dtype_name(x.dtype), tuple(x.shape)


def float32_tiles(x, axis: int, tile: int):
    """``x`` as a float32 NDArray (``mx.nd``) on its context, ``axis`` zero padded at its end to a multiple
    of ``tile`` and split in place into ``[tiles, tile]``."""
    v = (x.as_nd_ndarray() if isinstance(x, mx.np.ndarray) else x).astype("float32")
    shape = v.shape
    if shape[axis] % tile:
        pad = (*shape[:axis], -shape[axis] % tile, *shape[axis + 1 :])
        v = mx.nd.concat(v, mx.nd.zeros(pad, ctx=v.context, dtype="float32"), dim=axis)
    return v.reshape((*shape[:axis], -(-shape[axis] // tile), tile, *shape[axis + 1 :]))


def times(t, c):
    """``t * c``, ``c`` a numpy float32 constant broadcast against ``t``."""
    if not c.ndim:
        return t * float(c)
    return mx.nd.broadcast_mul(t, mx.nd.array(c, ctx=t.context, dtype="float32"))


def butterfly(t, axis: int, h: int):
    """In each group of ``2h`` along ``axis``, the first ``h`` (``a``) and the next ``h`` (``b``) become
    ``a + b`` and ``a - b``."""
    import math

    lead, rest = t.shape[:axis], t.shape[axis + 1 :]
    # the other axes merged: MKL-DNN takes at most 6 dimensions
    pairs = t.reshape((math.prod(lead), t.shape[axis] // (2 * h), 2, h, math.prod(rest)))
    a, b = (mx.nd.slice_axis(pairs, axis=2, begin=i, end=i + 1) for i in (0, 1))
    return mx.nd.concat(a + b, a - b, dim=2).reshape(t.shape)


def merge_tiles(t, axis: int):
    """``t`` with ``axis`` and ``axis + 1`` merged into one."""
    return t.reshape((*t.shape[:axis], t.shape[axis] * t.shape[axis + 1], *t.shape[axis + 2 :]))
