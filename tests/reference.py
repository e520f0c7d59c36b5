"""An independent, exact scalar reference for rounding: rational arithmetic with fractions.Fraction.

It follows the textbook definition (the two representable neighbours of the exact value, then a
rule to pick one) rather than the library's scaled-float algorithm, so agreement means something.
"""

from __future__ import annotations

import math
from fractions import Fraction

from polyamp.numerics import FloatFormat


def exponent(a: Fraction) -> int:
    """floor(log2(a)) for a > 0, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    return e


def neighbours(a: Fraction, fmt: FloatFormat) -> tuple[Fraction, Fraction]:
    """The representable values lo <= a < hi (or lo == hi == a) ignoring the top of the range."""
    if a == 0:
        return a, a
    e = max(exponent(a), fmt.emin)
    q = Fraction(2) ** (e - fmt.mbits)
    lo = math.floor(a / q) * q
    return (lo, lo) if lo == a else (lo, lo + q)


def round_exact(x: float, fmt: FloatFormat, rounding: str = "nearest", saturate: bool = False,
                up: bool | None = None) -> float:  # fmt: skip
    """Round the exact value of ``x``; ``up`` decides a stochastic choice (True: take hi)."""
    if math.isnan(x):
        return math.nan
    overflow = fmt.max if (saturate or fmt.saturates_always) else (math.inf if fmt.has_inf else math.nan)
    sign = -1.0 if math.copysign(1.0, x) < 0 else 1.0
    if (not fmt.signed and sign < 0) or (not fmt.has_zero and x == 0):
        return math.nan
    if math.isinf(x):
        r = overflow
    else:
        a = Fraction(abs(x))
        lo, hi = neighbours(a, fmt)
        if lo == hi:
            nearest = lo
        elif a - lo != hi - a:
            nearest = lo if a - lo < hi - a else hi
        else:
            nearest = lo if (lo / (hi - lo)) % 2 == 0 else hi
        picked = {"nearest": nearest, "toward_zero": lo, "stochastic": hi if up else lo}[rounding]
        if picked > Fraction(fmt.max):
            if rounding == "toward_zero" or nearest <= Fraction(fmt.max):
                r = fmt.max
            else:
                r = overflow
        else:
            r = float(picked)
    if r == 0 and not fmt.has_zero:
        r = fmt.min_normal
    r = math.copysign(r, sign) if not math.isnan(r) else r
    if r == 0 and not fmt.has_negative_zero:
        r = 0.0
    return r
