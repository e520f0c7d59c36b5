"""How the doctor's reports write shares and loss scales."""

from __future__ import annotations

import math


def pct(x: float | None) -> str:
    """A share as a percentage, to three significant digits; ``<0.01%`` below 1e-4, ``-`` for None."""
    if x is None:
        return "-"
    return "0" if x == 0 else f"{100 * x:.3g}%" if x >= 1e-4 else "<0.01%"


def pow2(scale: float | None) -> str:
    """A loss scale as ``2^k`` when it is a power of two, else as a number; ``none`` for None."""
    if scale is None:
        return "none"
    m, e = math.frexp(scale)
    return f"2^{e - 1}" if m == 0.5 else f"{scale:g}"


def pow2_expr(scale: float) -> str:
    """A loss scale as Python source: ``2.0**k`` when it is a power of two."""
    m, e = math.frexp(scale)
    return f"2.0**{e - 1}" if m == 0.5 else repr(scale)
