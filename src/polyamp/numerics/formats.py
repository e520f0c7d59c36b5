"""Low-precision floating-point formats, every fact derived from the bit layout.

A format is sign (optional) | ``ebits`` exponent bits | ``mbits`` mantissa bits with an exponent
``bias`` and one of four conventions for the special values:

- ``ieee``: the all-ones exponent holds +-inf (mantissa 0) and NaN (any other mantissa).
- ``fn``: no inf; only the all-ones code (exponent and mantissa) of each sign is NaN (OCP FP8 E4M3).
- ``fnuz``: no inf, no -0; the single code 1000...0 (negative zero's) is NaN.
- ``none``: no inf and no NaN; every code is a finite number (MX FP6/FP4).

``subnormals=False`` makes exponent field 0 an ordinary binade, so the format has no zero
(``e8m0fnu``, the MX shared scale, which is also unsigned).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import PolyampError

CONVENTIONS = ("ieee", "fn", "fnuz", "none")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format; see the module docstring for the conventions."""

    name: str
    ebits: int
    mbits: int
    bias: int
    special: str = "ieee"
    signed: bool = True
    subnormals: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise PolyampError(f"name must be a string, got {self.name!r}")
        for field in ("ebits", "mbits", "bias"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PolyampError(f"{field} must be an integer, got {value!r} ({type(value).__name__})")
        for field in ("signed", "subnormals"):
            if not isinstance(getattr(self, field), bool):
                raise PolyampError(f"{field} must be True or False, got {getattr(self, field)!r}")
        if not isinstance(self.special, str) or self.special not in CONVENTIONS:
            raise PolyampError(
                f"unknown special-value convention {self.special!r}; accepted: {', '.join(CONVENTIONS)}"
            )
        if not (1 <= self.ebits <= 8 and 0 <= self.mbits <= 23):
            raise PolyampError(
                f"format {self.name!r} has {self.ebits} exponent and {self.mbits} mantissa bits; "
                "accepted: 1-8 exponent bits and 0-23 mantissa bits (every value fits float32)"
            )
        if self.special == "ieee" and (self.mbits == 0 or self.ebits < 2):
            raise PolyampError(
                f"format {self.name!r}: the ieee convention needs >= 2 exponent bits and >= 1 "
                "mantissa bit (inf and NaN share the top binade); use special='fn' or 'none'"
            )
        if self.special == "fnuz" and not self.signed:
            raise PolyampError(
                f"format {self.name!r}: fnuz's NaN is the negative-zero code, which an unsigned format "
                "lacks; use special='fn' or 'none'"
            )
        if self.subnormals and self._top[0] == 0:
            raise PolyampError(
                f"format {self.name!r} has no finite non-zero value (its one binade holds only zero "
                "and NaN); accepted: more exponent or mantissa bits, or special='none'"
            )
        if self.emin - self.mbits < -149 or self.emax > 127:
            raise PolyampError(
                f"format {self.name!r} with bias {self.bias} spans 2^{self.emin - self.mbits}.."
                f"2^{self.emax}; accepted: values within float32's range (2^-149..2^127)"
            )

    # -- layout ------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total width in bits."""
        return int(self.signed) + self.ebits + self.mbits

    @property
    def storage_dtype(self) -> np.dtype:
        """Smallest unsigned integer dtype that holds one code."""
        return np.dtype(np.uint8 if self.bits <= 8 else np.uint16 if self.bits <= 16 else np.uint32)

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "none"

    @property
    def has_zero(self) -> bool:
        return self.subnormals

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.has_zero and self.special != "fnuz"

    @property
    def saturates_always(self) -> bool:
        """Formats with neither inf nor NaN can only clamp an overflow."""
        return not self.has_inf and not self.has_nan

    # -- range ---------------------------------------------------------------------------------
    @cached_property
    def _top(self) -> tuple[int, int]:
        """(exponent field, mantissa field) of the largest finite code."""
        top_field = (1 << self.ebits) - 1
        all_ones = (1 << self.mbits) - 1
        if self.special == "ieee":
            return top_field - 1, all_ones
        if self.special == "fn":
            return (top_field - 1, all_ones) if self.mbits == 0 else (top_field, all_ones - 1)
        return top_field, all_ones

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        return self._top[0] - self.bias

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return (1 if self.subnormals else 0) - self.bias

    @cached_property
    def max(self) -> float:
        """Largest finite value."""
        field, mant = self._top
        return math.ldexp(1 + mant / (1 << self.mbits), field - self.bias)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float | None:
        """Smallest positive subnormal, or None where the format has none."""
        if not self.subnormals or self.mbits == 0:
            return None
        return math.ldexp(1.0, self.emin - self.mbits)

    @property
    def smallest_positive(self) -> float:
        return self.min_subnormal or self.min_normal

    @property
    def eps(self) -> float:
        """Gap between 1 and the next larger value: 2^-mbits."""
        return math.ldexp(1.0, -self.mbits)

    @property
    def digits(self) -> int:
        """Decimal digits that survive a round trip (as numpy's finfo.precision)."""
        return int(self.mbits * math.log10(2))

    @property
    def nan_codes(self) -> int:
        sides = 2 if self.signed else 1
        return {"ieee": sides * ((1 << self.mbits) - 1), "fn": sides, "fnuz": 1, "none": 0}[self.special]

    @property
    def inf_codes(self) -> int:
        return (2 if self.signed else 1) if self.has_inf else 0

    @property
    def finite_codes(self) -> int:
        """Number of codes that are finite numbers (+0 and -0 count separately)."""
        return (1 << self.bits) - self.nan_codes - self.inf_codes

    def facts(self) -> dict[str, object]:
        """Every derived fact, for tables and ``--json``."""
        return {
            "name": self.name,
            "bits": self.bits,
            "sign": int(self.signed),
            "exponent_bits": self.ebits,
            "mantissa_bits": self.mbits,
            "bias": self.bias,
            "special": self.special,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "eps": self.eps,
            "digits": self.digits,
            "finite_codes": self.finite_codes,
            "has_inf": self.has_inf,
            "has_nan": self.has_nan,
            "negative_zero": self.has_negative_zero,
        }

    def __str__(self) -> str:
        return self.name


def _fmt(name, e, m, special="ieee", bias=None, **kw) -> FloatFormat:
    if bias is None:
        bias = (1 << (e - 1)) if special == "fnuz" else (1 << (e - 1)) - 1
    return FloatFormat(name, e, m, bias, special, **kw)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        _fmt("fp32", 8, 23),
        _fmt("tf32", 8, 10),
        _fmt("fp16", 5, 10),
        _fmt("bf16", 8, 7),
        _fmt("e4m3fn", 4, 3, "fn"),
        _fmt("e5m2", 5, 2),
        _fmt("e4m3fnuz", 4, 3, "fnuz"),
        _fmt("e5m2fnuz", 5, 2, "fnuz"),
        _fmt("e2m3fn", 2, 3, "none"),
        _fmt("e3m2fn", 3, 2, "none"),
        _fmt("e2m1fn", 2, 1, "none"),
        _fmt("e8m0fnu", 8, 0, "fn", signed=False, subnormals=False),
    )
}

ALIASES: dict[str, str] = {
    "float32": "fp32", "single": "fp32", "f32": "fp32",
    "tensorfloat32": "tf32",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bfloat16": "bf16",
    "e4m3": "e4m3fn", "fp8": "e4m3fn", "fp8_e4m3": "e4m3fn", "float8_e4m3fn": "e4m3fn",
    "fp8_e5m2": "e5m2", "float8_e5m2": "e5m2",
    "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2fnuz": "e5m2fnuz",
    "fp6_e2m3": "e2m3fn", "float6_e2m3fn": "e2m3fn",
    "fp6_e3m2": "e3m2fn", "float6_e3m2fn": "e3m2fn",
    "fp4": "e2m1fn", "fp4_e2m1": "e2m1fn", "float4_e2m1fn": "e2m1fn",
    "e8m0": "e8m0fnu", "float8_e8m0fnu": "e8m0fnu",
}  # fmt: skip

_CUSTOM = re.compile(r"e(\d{1,3})m(\d{1,3})_(ieee|fn|fnuz|none)")


def get_format(spec: str | FloatFormat) -> FloatFormat:
    """Look up a format by name, alias or custom ``eXmY_<convention>`` spelling.

    A custom name must state its convention (``e3m4_ieee``, ``e5m3_fn``, ``e4m4_fnuz``,
    ``e3m3_none``); the bias is the usual ``2^(X-1) - 1`` (``2^(X-1)`` for fnuz).
    """
    if isinstance(spec, FloatFormat):
        return spec
    if not isinstance(spec, str):
        raise PolyampError(f"expected a format name, got {type(spec).__name__} {spec!r}; {_accepted()}")
    key = spec.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    custom = _CUSTOM.fullmatch(key)
    if custom:
        e, m, special = int(custom[1]), int(custom[2]), custom[3]
        return _fmt(key, e, m, special, bias=None if 1 <= e <= 8 else 0)  # FloatFormat refuses e
    hint = ""
    if re.fullmatch(r"e\d+m\d+", key):
        hint = f" ({key} is ambiguous: state its convention, e.g. {key}_ieee or {key}_fn)"
    else:
        close = difflib.get_close_matches(key, [*FORMATS, *ALIASES], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PolyampError(f"unknown format {spec!r}{hint}; {_accepted()}")


def _accepted() -> str:
    return (
        f"accepted: {', '.join(FORMATS)}; aliases {', '.join(sorted(ALIASES))}; "
        "or a custom eXmY_<ieee|fn|fnuz|none>"
    )
