"""Bit codes: values <-> sign | exponent field | mantissa field, for any ``FloatFormat``.

decode: ``field == 0`` (with subnormals) is ``mant * 2^(emin - mbits)``, otherwise
``(2^mbits + mant) * 2^(field - bias - mbits)``; then the convention's inf/NaN codes.
encode: round with ``quantize`` first (exactly, so a code depends on the value only, never on the
input's dtype), then split each exact value with ``frexp``.
NaN encodes to one canonical code: quiet positive NaN (ieee), the positive all-ones code (fn),
``1000...0`` (fnuz). Codes are returned in the smallest unsigned dtype that holds them.
"""

from __future__ import annotations

import numbers
from decimal import Decimal

import numpy as np

from ..errors import PolyampError
from .formats import FloatFormat, get_format
from .rounding import exact_float64, quantize

_U = np.uint64


def decode(codes, fmt) -> np.ndarray:
    """Values (float64, exact) of integer bit codes of ``fmt``.

    >>> decode([0x7E, 0x7F, 0x38], "e4m3fn").tolist()
    [448.0, nan, 1.0]
    """
    fmt = get_format(fmt)
    try:
        c = np.asarray(codes)
    except (ValueError, TypeError, OverflowError) as err:
        raise PolyampError(
            f"cannot read {codes!r:.60} as an array of codes ({err}); accepted: a rectangular integer array"
        ) from None
    if c.size == 0 and c.dtype.kind == "f":
        c = c.astype(np.uint8)  # an empty list
    if c.dtype.kind not in "ui":
        raise PolyampError(f"codes must be an integer array, got dtype {c.dtype}; accepted: uint8/16/32")
    if c.size and (int(c.min()) < 0 or int(c.max()) >= 1 << fmt.bits):
        raise PolyampError(
            f"codes out of range for {fmt.name}: got {int(c.min())}..{int(c.max())}; "
            f"accepted: 0..{(1 << fmt.bits) - 1}"
        )
    c = c.astype(_U)
    m, top = fmt.mbits, (1 << fmt.ebits) - 1
    mant = c & _U((1 << m) - 1)
    field = (c >> _U(m)) & _U(top)
    sign = ((c >> _U(m + fmt.ebits)) & _U(1)).astype(bool) if fmt.signed else np.zeros(c.shape, bool)
    exp = field.astype(np.int64) - fmt.bias - m
    significand = mant.astype(np.float64) + np.where(field > 0 if fmt.subnormals else True, 2.0**m, 0.0)
    if fmt.subnormals:
        exp = np.where(field == 0, fmt.emin - m, exp)
    mag = np.ldexp(significand, exp.astype(np.int32))
    if fmt.special == "ieee":
        mag = np.where(field == top, np.where(mant == 0, np.inf, np.nan), mag)
    elif fmt.special == "fn":
        mag = np.where((field == top) & (mant == _U((1 << m) - 1)), np.nan, mag)
    elif fmt.special == "fnuz":
        mag = np.where(sign & (field == 0) & (mant == 0), np.nan, mag)
        sign = sign & ~np.isnan(mag)
    return np.where(sign, -mag, mag)


def encode(values, fmt, rounding: str = "nearest", saturate: bool = False, seed=None) -> np.ndarray:
    """Round ``values`` onto ``fmt`` (as ``quantize``) and return their bit codes.

    >>> encode([448.0, 464.0, 465.0, 1.0], "e4m3fn").tolist()
    [126, 126, 127, 56]
    """
    fmt = get_format(fmt)
    q = np.asarray(quantize(values, fmt, rounding, saturate, seed), dtype=np.float64)
    nan = np.isnan(q)
    if nan.any() and not fmt.has_nan:
        raise PolyampError(
            f"{fmt.name} has no NaN code, but the input holds NaN at index "
            f"{np.argwhere(nan)[0].tolist()}; accepted: finite or infinite values"
        )
    a = np.abs(np.where(nan, 0.0, q))
    _, e2 = np.frexp(a)
    e = e2.astype(np.int64) - 1
    m = fmt.mbits
    normal = (a >= fmt.min_normal) if fmt.subnormals else np.ones(a.shape, bool)
    with np.errstate(invalid="ignore"):
        field = np.where(normal, e + fmt.bias, 0)
        mant = np.where(normal, np.ldexp(a, (m - e).astype(np.int32)) - 2.0**m,
                        np.ldexp(a, m - fmt.emin))  # fmt: skip
    top = (1 << fmt.ebits) - 1
    inf = np.isinf(a)
    field = np.where(inf, top, field).astype(_U)
    mant = np.where(inf, 0.0, mant).astype(_U)
    code = (field << _U(m)) | mant
    if fmt.signed:
        code |= np.signbit(q).astype(_U) << _U(fmt.bits - 1)
    code = np.where(nan, _U(_nan_code(fmt)), code)
    return code.astype(fmt.storage_dtype)


def _nan_code(fmt: FloatFormat) -> int:
    m = fmt.mbits
    top = (1 << fmt.ebits) - 1
    if fmt.special == "ieee":
        return (top << m) | (1 << (m - 1))
    if fmt.special == "fn":
        return (top << m) | ((1 << m) - 1)
    return 1 << (fmt.bits - 1)  # fnuz


def neighbours(x, fmt) -> tuple[float | None, float | None]:
    """The largest representable value <= x and the smallest >= x (None where there is none).

    ``x`` is one real number (a Python int, Fraction or Decimal counts with its exact value).

    >>> neighbours(0.3, "e2m1fn")
    (0.0, 0.5)
    """
    fmt = get_format(fmt)
    if isinstance(x, np.ndarray) and x.ndim == 0:
        x = x[()]
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Rational, float, Decimal, np.floating)):
        raise PolyampError(
            f"neighbours takes one real number, got {x!r:.60}; accepted: an int, float, Fraction or Decimal"
        )
    x = exact_float64(x)
    if np.isnan(x):
        return None, None
    if x < 0 and not fmt.signed:
        return None, (0.0 if fmt.has_zero else fmt.min_normal)
    below, above = _magnitude_neighbours(abs(x), fmt)
    if x >= 0:
        return below, above
    # mirror |x| (-0 reads as +0); in a format without zero, +min is the next value above -min
    lower = None if above is None else -above
    upper = fmt.min_normal if below is None else (0.0 if below == 0 else -below)
    return lower, upper


def _magnitude_neighbours(a: float, fmt: FloatFormat) -> tuple[float | None, float | None]:
    if a > fmt.max:
        return fmt.max, None
    if not fmt.has_zero and a < fmt.min_normal:
        return None, fmt.min_normal
    below = float(quantize(a, fmt, "toward_zero"))
    if below == a:
        return a, a
    return below, float(decode([int(encode(below, fmt)) + 1], fmt)[0])
