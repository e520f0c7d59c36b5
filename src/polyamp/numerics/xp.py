"""numpy's array primitives: the ops module of the core's own arrays (``exact_float`` runs over it).

The front ends' ``polyamp.<framework>.xp`` modules offer the same functions in their framework's ops.
Integer words are uint64 (numpy's multiplies wrap mod 2^64).
"""

from __future__ import annotations

import numpy as np

NAME = "numpy"


# -- rounding and block formats ------------------------------------------------------------------------
def const(value: float, like):
    """A scalar operand next to ``like`` (numpy takes the number itself)."""
    return value


def size(v) -> int:
    return v.size


def abs(v):  # noqa: A001 - the ops vocabulary
    return np.abs(v)


def spacing(a, lo: int, hi: int, mbits: int):
    """``(t, q)``: ``q = 2^(e - mbits)``, ``e = floor(log2 a)`` clamped to ``[lo, hi]``, ``t = a / q``."""
    _, e2 = np.frexp(a)
    e = np.minimum(np.maximum(e2 - 1, lo), hi)  # frexp: a = m * 2^e2, m in [0.5, 1)
    q = np.ldexp(1.0, e - mbits)
    return a / q, q


def rint(t):
    """Round to the nearest integer, ties to even."""
    return np.rint(t)


def floor(t):
    return np.floor(t)


def minimum(a, b):
    return np.minimum(a, b)


def maximum(a, b):
    return np.maximum(a, b)


def where(cond, a, b):
    return np.where(cond, a, b)


def isnan(v):
    return np.isnan(v)


def isinf(v):
    return np.isinf(v)


def isfinite(v):
    return np.isfinite(v)


def keep_nan(r, a):
    """``r`` with the canonical NaN where ``a`` is NaN."""
    return np.where(np.isnan(a), np.nan, r)


def copysign(r, v):
    return np.copysign(r, v)


def float64(v):
    return v.astype(np.float64)


def integer(flags):
    """Flags as 0 / 1 of the exponents' integer type."""
    return flags.astype(np.int64)


def clip(v, lo, hi):
    return np.clip(v, lo, hi)


def exponent(a):
    """floor(log2 a) of finite ``a`` > 0 (exact, from frexp), int64."""
    return np.frexp(a)[1].astype(np.int64) - 1


def pow2(k):
    """2^k in float64 for integer ``k``."""
    return np.ldexp(1.0, k.astype(np.int32))


def may_hold(flags) -> bool:
    """Whether any flag is set."""
    return bool(flags.any())


def finite_max(a):
    """max of the finite elements of ``a`` >= 0 (0 if none), float64."""
    return np.max(np.where(np.isfinite(a), a, 0.0), initial=0.0)


def item(v) -> float:
    return float(v)


def float32_round(v):
    """float64 ``v`` rounded once to float32, back as float64."""
    return np.float64(np.float32(v))


def float32(v):
    """``v`` (float32 values) as a float32 array."""
    return v.astype(np.float32)


def moveaxis(v, src, dst):
    return np.moveaxis(v, src, dst)


def pad_end(v, widths):
    """``v`` with ``widths[i]`` zeros appended along axis ``i``."""
    return np.pad(v, [(0, w) for w in widths])


def reshape(v, shape):
    return v.reshape(shape)


def amax(v, axes):
    """max over ``axes`` (NaN wins), 0 for an empty reduction."""
    return v.max(axis=axes, initial=0.0)


def repeat(v, b: int, axis: int, length: int):
    """Each entry repeated ``b`` times along ``axis``, cut to ``length``."""
    out = np.repeat(v, b, axis=axis)
    return out if out.shape[axis] == length else out.take(np.arange(length), axis=axis)


def words(start: int, stop: int, like):
    """The 64-bit words ``start .. stop - 1``."""
    return np.arange(start, stop, dtype=np.uint64)


def word(c: int, like):
    """A 64-bit constant (``0 <= c < 2^64``)."""
    return np.uint64(c)


def xor(a, b):
    return a ^ b


def shr(z, s: int):
    """Logical right shift of 64-bit words."""
    return z >> np.uint64(s)


def unit53(z):
    """The top 53 bits of 64-bit words as a float64 in [0, 1)."""
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


# -- optimizer state codes (``numerics.state_codes``) -------------------------------------------------
def cast(v, dtype: str):
    import ml_dtypes

    return np.asarray(v).astype(getattr(ml_dtypes, dtype, None) or np.dtype(dtype))


def take(table, codes):
    return table[codes.astype(np.intp)]


def high16(v):
    """The top 16 bits of float32 ``v`` (sign, exponent, 7 fraction bits) as integers."""
    return np.asarray(v, np.float32).view(np.uint32) >> 16


def unpack4(codes):
    """Two 4-bit codes per byte (low nibble first) -> one code per uint8, the last axis doubled."""
    return np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
