"""The float64 route of exact rounding and block formats, written once over an ops module.

``ops`` is ``polyamp.numerics.xp`` (numpy) or a front end's ``polyamp.<framework>.xp`` (torch, MXNet):
the functions here call only its primitives, so the numpy core without numba, torch and MXNet run one
algorithm (``rounding.py`` and ``blocks.py`` state it). Every input value converts to float64 exactly
and every step below is exact in float64 except the one rounding each function names.

Scalar rounding (``round_float64``): ``ops.spacing`` gives ``q = 2^(e - mbits)`` with ``e`` the exponent
of ``a = |x|`` clamped to ``[emin, emax + 1]``, and ``t = a / q`` (exact); nearest ``rint(t)`` (ties to
even), toward zero ``floor(t)``, stochastic ``floor(t) + (u < t - floor(t))`` with ``u`` the splitmix64
stream (``stream.uniform53``); then overflow, inf, NaN, sign, -0, unsigned and zero-less formats.

Block formats (``encode_blocks``): block amax (zero padded, NaN wins), the MX scale exponent or NVFP4's
block scales over its float32 global scale, the elements rounded (saturating) from ``x / scale``;
``block_values`` multiplies them back, ``element * scale (* global)``, exact in float64.
"""

from __future__ import annotations

import math
import sys
from decimal import Decimal
from fractions import Fraction

import numpy as np

from .formats import FloatFormat
from .stream import mix, uniform53

NEAREST, STOCHASTIC, TOWARD_ZERO = 0, 1, 2  # rounding.ROUNDINGS' codes
NVFP4_RANGE = 448 * 6
FLT_MAX = float(np.finfo(np.float32).max)


def overflow_value(fmt: FloatFormat, saturate: bool) -> float:
    """What a value past ``fmt``'s max becomes: the max when saturating (or the format has no inf /
    NaN), else inf or NaN."""
    return fmt.max if (saturate or fmt.saturates_always) else (math.inf if fmt.has_inf else math.nan)


def round_float64(ops, v, fmt: FloatFormat, mode: int, saturate: bool, seed: int, offset: int = 0):
    """float64 ``v`` rounded onto ``fmt``, float64 out; stochastic draws by flat index from ``offset``."""
    overflow = overflow_value(fmt, saturate)
    maxval = ops.const(fmt.max, v)
    a = ops.abs(v)
    t, q = ops.spacing(a, fmt.emin, fmt.emax + 1, fmt.mbits)
    if mode == TOWARD_ZERO:
        r = ops.minimum(ops.floor(t) * q, maxval)  # never overflows a finite value
    elif mode == NEAREST:
        r = ops.rint(t) * q
        saturated = overflow == fmt.max
        r = ops.minimum(r, maxval) if saturated else ops.where(r > maxval, ops.const(overflow, v), r)
    else:  # stochastic: no unbiased answer past max; there it takes nearest's
        f = ops.floor(t)
        u = ops.reshape(uniform53(ops, mix(seed), ops.size(v), v, offset), v.shape)
        r = (f + ops.float64(u < t - f)) * q
        if overflow == fmt.max:
            r = ops.minimum(r, maxval)
        else:
            past = ops.where(ops.rint(t) * q > maxval, ops.const(overflow, v), maxval)
            r = ops.where(r > maxval, past, r)
    if overflow != fmt.max:
        r = ops.where(ops.isinf(a), ops.const(overflow, v), r)
    r = ops.copysign(ops.keep_nan(r, a), v)
    if not fmt.has_negative_zero:
        r = r + 0.0  # -0 + 0 is +0
    if not fmt.signed:
        r = ops.where(v < 0, math.nan, r)
    if not fmt.subnormals:
        r = ops.where(a == 0, math.nan, ops.where((a > 0) & (r == 0), ops.const(fmt.min_normal, v), r))
    return r


# -- block formats --------------------------------------------------------------------------------------
def encode_blocks(ops, x64, bf, axes, shape, rule, mode: int, seed: int, wide: bool, round_saturated=None):
    """(elements, scales, global scale or None) of float64 ``x64`` in the block format ``bf``: elements on
    the element grid in x's layout, scales (NaN for a block holding NaN / inf) in the scales' layout.
    ``wide``: ``x`` is float64 (NVFP4's global scale then needs the exact quotient). The roundings go through
    ``round_saturated(v, fmt, mode, seed, narrow)``, by default ``ops.round_saturated``."""
    rnd = round_saturated or ops.round_saturated
    a = ops.abs(x64)
    amax = block_amax(ops, a, axes, shape)
    bad = ~ops.isfinite(amax)
    any_bad = ops.may_hold(bad)
    if any_bad:  # NaN / inf blocks: scale NaN, elements computed from 0
        amax = ops.where(bad, 0.0, amax)
        x64 = ops.where(expand(ops, bad, axes, shape, x64.shape), 0.0, x64)
    if bf.scale.name == "e8m0fnu":
        k = mx_exponent(ops, amax, bf.element, rule)
        scales = ops.pow2(k)
        scaled = x64 * expand(ops, ops.pow2(-k), axes, shape, x64.shape)  # exact
        elements = rnd(scaled, bf.element, mode, seed, not wide)
        g = None
    else:
        g = nvfp4_global(ops, a, wide)
        scales = rnd(amax / ops.const(g * bf.element.max, amax), bf.scale, NEAREST, 0, False)
        zero = scales == 0  # s_block rounded to 0: the block holds +-0
        den = scales
        if ops.may_hold(zero):
            x64 = ops.where(expand(ops, zero, axes, shape, x64.shape), x64 * 0.0, x64)  # x64 is finite here
            den = ops.where(zero, 1.0, scales)
        den = expand(ops, den, axes, shape, x64.shape) * ops.const(g, x64)
        elements = rnd(x64 / den, bf.element, mode, seed, False)
    if any_bad:
        scales = ops.where(bad, math.nan, scales)
    return elements, scales, g


def block_values(ops, axes, shape, elements, scales, g):
    """element * scale (* global scale) in float64 (exact)."""
    s = expand(ops, scales, axes, shape, elements.shape)
    v = elements * s  # NaN where the scale is NaN (IEEE multiplication propagates the NaN operand)
    return v if g is None else v * ops.const(g, v)


def mx_exponent(ops, amax, elem: FloatFormat, rule: str):
    """The E8M0 exponent of each block (finite ``amax`` >= 0) per ``rule``, clamped to [-127, 127]; the
    rules compare on ``k`` clamped to [-128, 127] first, where the final clamp decides the rest."""
    k = ops.clip(ops.exponent(amax) - elem.emax, -128, 127)  # exponent: floor(log2 amax), exact
    e = k + elem.emax
    if rule == "rceil":
        k = k + ops.integer(amax > ops.pow2(k) * elem.max)
    elif rule == "ceil":
        k = k + ops.integer(amax > ops.pow2(e))
    elif rule == "even":
        k = k + ops.integer(amax >= ops.pow2(e) * (2.0 - 2.0 ** -(elem.mbits + 1)))
    return ops.clip(ops.where(amax == 0, -127, k), -127, 127)


def nvfp4_global(ops, a, wide: bool):
    """NVFP4's global scale float32(amax / 2688) over the finite elements of ``a = |x|``, rounded once
    (1 without a finite non-zero element, at least 2^-149): for a float32 amax the float64 quotient never
    lies on a float32 midpoint, so its cast rounds as the exact one; a float64 amax takes the exact
    quotient (``global_scale``, one host read)."""
    return nvfp4_global_of(ops, ops.finite_max(a), wide)


def nvfp4_global_of(ops, amax, wide: bool):
    """``nvfp4_global`` from the finite amax."""
    if wide:
        return ops.const(global_scale(ops.item(amax)), amax)
    g = ops.maximum(ops.float32_round(amax / NVFP4_RANGE), 2.0**-149)
    return ops.where(amax == 0, 1.0, g)


def exact_float64(x) -> float:
    """A float64 that every format rounds as it would round the exact Python number ``x``.

    ``x`` itself when float64 holds it; otherwise its truncation to float64's 53 significant bits with
    the last bit set (round to odd; then rounding to any format of <= 51 bits is correct), clamped to
    float64's range (a finite value beyond it stays finite; a tiny non-zero one stays non-zero).
    """
    if isinstance(x, (float, np.floating)):
        return float(x)
    if isinstance(x, Decimal):
        if x.is_nan():
            return math.nan
        if not x.is_finite() or x.is_zero():
            return float(x)
        if not -330 < x.adjusted() < 310:  # far outside float64's range: skip the huge Fraction
            return (-1.0 if x.is_signed() else 1.0) * (sys.float_info.max if x.adjusted() > 0 else 5e-324)
    q = Fraction(x)
    sign, n, d = (-1.0 if q < 0 else 1.0), abs(q.numerator), q.denominator
    if n == 0:
        return 0.0
    e = n.bit_length() - d.bit_length()  # floor(log2 |q|) is e or e - 1
    if (n << max(-e, 0)) < (d << max(e, 0)):
        e -= 1
    if e > 1023:
        return sign * sys.float_info.max
    s = max(e, -1022) - 52  # float64's spacing at |q|
    k, rest = divmod(n << max(-s, 0), d << max(s, 0))
    return sign * math.ldexp(k | (rest != 0), s)


def global_scale(amax: float) -> float:
    """float32(amax / 2688) of a float64 amax, rounded once from the exact quotient; 1 for 0."""
    if amax == 0:
        return 1.0
    g = exact_float64(Fraction(amax) / NVFP4_RANGE)
    if g >= FLT_MAX:  # float64 input beyond 2688 * float32's max (float32 input never gets here)
        return FLT_MAX
    return max(float(np.float32(g)), 2.0**-149)


def block_amax(ops, a, axes: tuple[int, ...], shape: tuple[int, ...]):
    """max over each block (NaN if the block holds NaN), in the scales' layout; a partial block is zero
    padded (``a`` >= 0, so padding never wins)."""
    nb, lead = len(axes), a.ndim - len(axes)
    moved = ops.moveaxis(a, axes, tuple(range(lead, a.ndim)))
    sizes = moved.shape[lead:]
    counts = [-(-n // b) for n, b in zip(sizes, shape)]
    pads = [c * b - n for n, b, c in zip(sizes, shape, counts)]
    if any(pads):
        moved = ops.pad_end(moved, [0] * lead + pads)
    split = list(moved.shape[:lead])
    for c, b in zip(counts, shape):
        split += [c, b]
    amax = ops.amax(ops.reshape(moved, tuple(split)), tuple(lead + 2 * i + 1 for i in range(nb)))
    return ops.moveaxis(amax, tuple(range(lead, a.ndim)), axes)


def expand(ops, per_block, axes, shape, full):
    """Each block's entry repeated over its elements: the scales' layout -> x's layout (``full``)."""
    out = per_block
    for ax, b in zip(axes, shape):
        out = ops.repeat(out, b, ax, full[ax])
    return out
