"""The exact integer route of rounding and block formats, written once over an integer ops module.

``ops`` is a front end's ``polyamp.<framework>.xp_int`` (TensorFlow: uint64 significands; JAX: uint32, or
uint64 under x64): the functions here call only its integer primitives, so both front ends run one
algorithm, bit-identical to the core (``rounding.py`` and ``blocks.py`` state it). Integer ops, because
those frameworks flush float32 subnormals on the CPU (and JAX has no float64 by default). A value is an
exact :class:`Num`, ``(-1)^neg * sig * 2^exp`` with an unsigned ``sig`` and an int32 ``exp``:

1. ``decompose`` reads it from a float's bit pattern (float16, bfloat16, float32, float64);
2. ``round_to_grid`` is the core's rounding on it: ``e = exp + msb(sig)`` clamped to ``[emin, emax + 1]``,
   spacing ``2^qe`` with ``qe = e - mbits``; drop ``s = qe - exp`` low bits; nearest adds one when the
   dropped bits exceed half (ties to even), toward zero drops them, stochastic adds one when the stream's
   ``u < rem / 2^s`` (``stream.below``, compared exactly in integers); then overflow, inf, NaN, -0,
   unsigned and zero-less formats as the core;
3. ``compose`` writes the result's bit pattern (NaN is the canonical quiet NaN).

Block formats (``block_values``): amax as the max of the ``|x|`` bit patterns (a NaN or inf block has the
largest pattern and becomes NaN), MX scale exponents from the amax's exponent and top-aligned significand
(``x / 2^k`` is an exponent shift), NVFP4's quotients as long divisions with a sticky bit (round to odd: one
rounding of them equals rounding the exact quotient); NVFP4 with stochastic rounding draws against the
core's float64 quotient, reproduced as a 57-bit division rounded to 53 bits.

A grid's fields and the MX scale rule are Python values (decided while tracing) or traced arrays (JAX:
one compilation for every format): the flag algebra below (``_and``, ``_or``, ``_not``) folds Python
booleans away and combines traced ones in the graph.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .blocks import SCALE_RULES
from .exact_float import NEAREST, STOCHASTIC, TOWARD_ZERO, expand
from .formats import FORMATS
from .grid import FLOAT64, Grid

FP32_SATURATING = Grid.of(FORMATS["fp32"], True)
FP32 = Grid.of(FORMATS["fp32"], False)
_RCEIL, _CEIL, _EVEN = (SCALE_RULES.index(r) for r in ("rceil", "ceil", "even"))


class Num(NamedTuple):
    """``(-1)^neg * sig * 2^exp`` (sig unsigned, exp int32), or NaN / inf where those flags are set."""

    neg: Any
    sig: Any
    exp: Any
    nan: Any
    inf: Any


# -- flags that are Python booleans or traced ------------------------------------------------------
def _static(m) -> bool:
    return isinstance(m, (bool, np.bool_))


def _not(m):
    return (not m) if _static(m) else ~m


def _and(a, b):
    if _static(a):
        return b if a else False
    if _static(b):
        return a if b else False
    return a & b


def _or(a, b):
    if _static(a):
        return True if a else b
    if _static(b):
        return True if b else a
    return a | b


def _mask(ops, m, like):
    """A flag as a mask of ``like``'s shape."""
    if not _static(m):
        return m
    none = ops.zeros_like(like)
    return ~none if m else none


# -- exact numbers ---------------------------------------------------------------------------------
def shl(ops, u, s):
    """``u << s`` for int32 shift amounts, 0 where s >= width (s < 0 is treated as 0)."""
    w = ops.width(u)
    return ops.select(s >= w, 0, ops.shift_left_by(u, ops.clamp_int(s, 0, w - 1)))


def shr(ops, u, s):
    """``u >> s`` (logical) for int32 shift amounts, 0 where s >= width."""
    w = ops.width(u)
    return ops.select(s >= w, 0, ops.shift_right_by(u, ops.clamp_int(s, 0, w - 1)))


def decompose(ops, x, u=None) -> Num:
    """The exact value of each element of a float tensor (``sig`` of the unsigned type ``u``; by default
    the front end's for ``x``'s width)."""
    return decompose_bits(ops, ops.bits(x), x.dtype, u)


def decompose_bits(ops, b, dtype, u=None) -> Num:
    """The exact value of float bit patterns ``b`` (unsigned) of ``dtype``."""
    e, m = ops.layout(dtype)
    b = ops.widen(b, u)
    field = ops.int32(ops.bit_and(ops.shift_right(b, m), (1 << e) - 1))
    mant = ops.bit_and(b, (1 << m) - 1)
    top = ops.eq(field, (1 << e) - 1)
    sig = ops.select(top, 0, ops.select(ops.eq(field, 0), mant, mant | ops.uint(1 << m, b)))
    exp = ops.maximum(field, 1) - ((1 << (e - 1)) - 1) - m
    zero_mant = ops.eq(mant, 0)
    return Num(ops.eq(ops.shift_right(b, e + m), 1), sig, exp, top & ~zero_mant, top & zero_mant)


def compose(ops, num: Num, dtype):
    """The bit pattern of ``num`` in ``dtype``, as a ``dtype`` tensor: exact for values it holds, inf
    beyond its range."""
    e, m = ops.layout(dtype)
    bias = (1 << (e - 1)) - 1
    sig = num.sig
    p = ops.msb(sig)
    ve = num.exp + p
    normal_bits = ops.bit_and(ops.select(p <= m, shl(ops, sig, m - p), shr(ops, sig, p - m)), (1 << m) - 1)
    normal_bits = normal_bits | ops.shift_left(ops.to_uint(ops.clamp_int(ve + bias, 0, (1 << e) - 1), sig), m)
    sub_bits = shl(ops, sig, num.exp - (1 - bias - m))
    finite = ops.select(ve >= 1 - bias, normal_bits, sub_bits)
    nz = ops.ne(sig, 0)
    inf = num.inf | (nz & (ve + bias >= (1 << e) - 1))
    out = ops.select(nz, finite, 0)
    out = ops.select(inf, ops.uint(((1 << e) - 1) << m, sig), out)
    out = ops.select(num.nan, ops.uint((((1 << e) - 1) << m) | (1 << (m - 1)), sig), out)
    out = out | ops.shift_left(ops.to_uint(num.neg, sig), e + m)
    return ops.from_bits(out, dtype)


def constant(ops, value: float, like) -> Num:
    """A positive finite float as an exact ``Num`` of scalars (significand of ``like``'s type)."""
    n, d = float(value).as_integer_ratio()
    no = ops.flag(False)
    return Num(no, ops.uint(n, like), ops.int32_scalar(-(d.bit_length() - 1)), no, no)


def broadcast(ops, num: Num, shape) -> Num:
    return Num(*(ops.broadcast_to(f, shape) for f in num))


# -- the rounding ----------------------------------------------------------------------------------
def round_to_grid(ops, num: Num, g: Grid, mode: int, stream) -> Num:
    """``num`` rounded onto the grid ``g`` (module docstring, step 2); ``stream`` (stochastic rounding)
    offers ``below(rem, s)``: ``u < rem / 2^s`` per element."""
    ovf_max, ovf_nan, pos_zero, signed, subnormals = (
        bool(v) if _static(v) else v for v in (g.ovf_max, g.ovf_nan, g.pos_zero, g.signed, g.subnormals)
    )
    sig = num.sig
    w = ops.width(sig)
    one = ops.uint(1, sig)
    nz = ops.ne(sig, 0)
    e = num.exp + ops.msb(sig)  # floor(log2 |x|) where nz
    qe = ops.clamp_int(e, g.emin, g.emax + 1) - g.mbits
    s = qe - num.exp  # low bits to drop (< 0: exact, shift up)
    f = shl(ops, shr(ops, sig, s), -s)
    rem = sig & ops.select(s >= w, ops.uint((1 << w) - 1, sig), shl(ops, one, s) - one)
    half = shl(ops, one, s - 1)
    up = (s >= 1) & (s <= w) & ((rem > half) | (ops.eq(rem, half) & ops.eq(f & one, 1)))
    nearest = f + ops.to_uint(up, sig)

    def over(r):  # r * 2^qe > max
        return nz & ((e > g.emax) | (ops.eq(qe, g.emax - g.mbits) & (r > g.fm)))

    if mode == NEAREST:
        r, to_max, to_over = nearest, False, over(nearest)
    elif mode == TOWARD_ZERO:
        r, to_max, to_over = f, over(f), False
    else:
        over_n = over(nearest)
        r = f + ops.to_uint(stream.below(rem, s), sig)
        over_s = over(r)
        to_max, to_over = over_s & ~over_n, over_s & over_n
    to_over = _or(to_over, num.inf) & ~num.nan
    if ovf_max is not False:
        to_max, to_over = _or(to_max, _and(to_over, ovf_max)), _and(to_over, _not(ovf_max))
    sig_out, exp_out = r, qe
    if to_max is not False:
        sig_out = ops.select(to_max, ops.uint(g.fm, sig), r)
        exp_out = ops.select(to_max, g.emax - g.mbits, qe)
    nan = _or(num.nan, _and(to_over, ovf_nan))
    inf = _and(to_over, _not(ovf_nan))
    zero = _and(ops.eq(sig_out, 0) & ~nan, _not(inf))
    neg = num.neg
    if pos_zero is not False:
        neg = neg & ~_and(zero, pos_zero)
    unsigned = _not(signed)
    if unsigned is not False:  # negative input -> +NaN
        negative = _and(num.neg & ~num.nan & _or(nz, num.inf), unsigned)
        nan, neg = nan | negative, neg & ~negative
    zeroless = _not(subnormals)
    if zeroless is not False:  # no zero: 0 -> +NaN, a non-zero that rounds to 0 -> +min_normal
        zero_in = _and(~nz & ~num.nan & ~num.inf, zeroless)
        to_min = _and(nz & zero & ~nan, zeroless)
        sig_out = ops.select(to_min, one, sig_out)
        exp_out = ops.select(to_min, g.emin, exp_out)
        neg = neg & ~zero_in & ~to_min
        nan = nan | zero_in
    return Num(neg, sig_out, exp_out, nan, _mask(ops, inf, nz))


def divide(ops, n: Num, d: Num, bits: int) -> Num:
    """``n / d`` (d > 0) as ``bits`` quotient bits plus a sticky bit: long division of the significands
    top-aligned at bit width - 3, so the quotient is >= 2^(bits - 2) and rounding it to fewer than
    bits - 2 significant bits rounds the exact quotient (round to odd)."""
    top = ops.width(n.sig) - 3
    pn, pd = ops.msb(n.sig), ops.msb(d.sig)
    r = shl(ops, n.sig, top - pn)
    dd = shl(ops, d.sig, top - pd)
    q = ops.zeros_like(r)
    for _ in range(bits):
        bit = r >= dd
        r = ops.select(bit, r - dd, r)
        q = ops.shift_left(q, 1) | ops.to_uint(bit, q)
        r = ops.shift_left(r, 1)
    sig = ops.shift_left(q, 1) | ops.to_uint(ops.ne(r, 0), q)
    exp = (n.exp - (top - pn)) - (d.exp - (top - pd)) - bits
    return Num(ops.ne(n.neg, d.neg), sig, exp, n.nan, n.inf)


# -- per-tensor scaling ----------------------------------------------------------------------------
def eps_floor(scaled_max: float, eps: float):
    """For ``recipes._scale``'s floor ``max(amax, eps)`` on float32 amaxes: the bit pattern ``t`` of the
    least float32 >= ``eps`` (a non-negative float32 amax is below ``eps`` exactly when its bits are below
    ``t``) and the float32 scale of ``eps`` itself, ``scaled_max / eps`` in float64 rounded once (float32's
    max where that overflows)."""
    t = np.float32(eps)
    t = t if float(t) >= eps else np.nextafter(t, np.float32(np.inf))
    with np.errstate(over="ignore"):
        q_eps = np.float32(scaled_max / eps)
    return int(np.asarray(t).view(np.uint32)), (np.finfo(np.float32).max if np.isinf(q_eps) else q_eps)


def scale_from_amax(ops, amax_bits, scaled_max: float, fallback, eps: float = 0.0):
    """``recipes._scale`` of one float32 amax given as its bit pattern: ``scaled_max / max(amax, eps)``
    rounded once to float32 (long division), float32's max where that overflows, ``fallback`` where the
    amax is 0 or not finite; a float32 scalar."""
    amax = decompose_bits(ops, amax_bits, ops.FLOAT32)
    q = divide(ops, constant(ops, scaled_max, amax.sig), amax, 29)
    q = compose(ops, round_to_grid(ops, q, FP32_SATURATING, NEAREST, None), ops.FLOAT32)
    ok = (amax_bits < 0x7F800000) & ops.ne(amax_bits, 0)
    if eps > 0:  # a float32 amax below eps: the (constant) scale of eps itself
        threshold, q_eps = eps_floor(scaled_max, eps)
        below = amax_bits < threshold
        q, ok = ops.select(below, q_eps, q), ok | below
    return ops.select(ok, q, fallback)


def tensorwise(ops, x32, scale, fmt_grid: Grid, mode: int, stream):
    """``recipes.quantize_tensorwise``: ``fp32(x * scale)`` rounded onto ``fmt_grid`` (saturating),
    divided by ``scale`` (rounded to float32); float32 ``x32`` and ``scale`` in, float32 out."""
    x, s = decompose(ops, x32), decompose(ops, scale)
    product = round_to_grid(ops, Num(x.neg, x.sig * s.sig, x.exp + s.exp, x.nan, x.inf), FP32, NEAREST, None)
    q = round_to_grid(ops, product, fmt_grid, mode, stream)
    return compose(ops, round_to_grid(ops, divide(ops, q, s, 29), FP32, NEAREST, None), ops.FLOAT32)


# -- block formats ---------------------------------------------------------------------------------
def block_values(ops, x, bf, elem: Grid, rule, axes, shape, mode: int, stream, u):
    """The values of ``quantize_blocks`` (arguments checked), as in ``blocks._Encoding.of``: float64 for
    float64 ``x``, else float32. ``bf`` is None for MX formats (their element grid is ``elem``, their
    scale rule's index in ``SCALE_RULES`` ``rule``); ``u``: the significands' unsigned type."""
    wide = x.dtype == ops.FLOAT64
    full = ops.dims(x)
    num = decompose(ops, x, u)
    abs_bits, inf_bits = ops.abs_bits(x), ops.inf_bits(x.dtype)
    amax_bits = block_amax(ops, abs_bits, axes, shape)
    bad = amax_bits >= inf_bits  # a NaN or inf block: NaN values, elements computed from 0
    amax = decompose_bits(ops, ops.select(bad, 0, amax_bits), x.dtype, u)
    bad_x = expand(ops, bad, axes, shape, full)
    num = Num(num.neg, ops.select(bad_x, 0, num.sig), num.exp,
              ops.zeros_like(num.nan), ops.zeros_like(num.inf))  # fmt: skip
    if bf is None:
        kx = expand(ops, mx_exponent(ops, amax, elem, rule), axes, shape, full)
        e = round_to_grid(ops, num._replace(exp=num.exp - kx), elem, mode, stream)
        value = e._replace(exp=e.exp + kx)
    else:
        g = nvfp4_global_of_bits(ops, abs_bits, inf_bits, x.dtype, u)
        sx = Num(*(expand(ops, f, axes, shape, full) for f in nvfp4_scales(ops, amax, g, bf)))
        den_sig = sx.sig * g.sig
        zero = ops.eq(den_sig, 0)  # s_block rounded to 0: the block holds +-0
        den = Num(sx.neg, ops.select(zero, 1, den_sig), sx.exp + g.exp, sx.nan, sx.inf)
        num = num._replace(sig=ops.select(zero, 0, num.sig))
        if mode == STOCHASTIC:  # the core draws against the float64 quotient: make it, then round
            t = round_to_grid(ops, divide(ops, num, den, 57), FLOAT64, NEAREST, None)
            e = round_to_grid(ops, t, elem, mode, stream)
        else:
            e = round_to_grid(ops, divide(ops, num, den, bf.element.mbits + 5), elem, mode, None)
        value = Num(e.neg, e.sig * sx.sig * g.sig, e.exp + sx.exp + g.exp, e.nan, e.inf)
        if not wide:  # the core's float64 product is exact; its cast to float32 rounds once
            value = round_to_grid(ops, value, FP32, NEAREST, None)
    value = Num(value.neg & ~bad_x, value.sig, value.exp, value.nan | bad_x, value.inf & ~bad_x)
    return compose(ops, value, ops.FLOAT64 if wide else ops.FLOAT32)


def mx_exponent(ops, amax: Num, g: Grid, rule):
    """The E8M0 exponent per block (``blocks._mx_exponent``) for the element grid ``g`` and the scale
    rule's index ``rule`` in ``SCALE_RULES``, from the amax's exponent and its significand top-aligned at
    bit width - 2: rceil compares it with Fmax's, ceil with 2^e's, even with (2 - 2^-(m+1)) * 2^e."""
    w = ops.width(amax.sig)
    p = ops.msb(amax.sig)
    e = amax.exp + p
    top = shl(ops, amax.sig, (w - 2) - p)
    one = 1 << (w - 2)
    if isinstance(rule, (int, np.integer)) and isinstance(g.mbits, int):  # decided now
        up = None
        if rule == _RCEIL:
            up = top > ops.uint(g.fm << (w - 2 - g.mbits), top)
        elif rule == _CEIL:
            up = ops.ne(top, ops.uint(one, top))
        elif rule == _EVEN:
            up = top >= ops.uint(2 * one - (one >> (g.mbits + 1)), top)
    else:
        one_u = ops.uint(one, top)
        fmax = shl(ops, ops.uint(g.fm, top), (w - 2) - g.mbits)
        even = 2 * one_u - shr(ops, one_u, g.mbits + 1)
        # nested wheres, not a select: JAX's select breaks lowering under a scoped enable_x64 in a jit
        up_even = (rule == _EVEN) & (top >= even)
        up = ops.select(rule == _RCEIL, top > fmax, ops.select(rule == _CEIL, ops.ne(top, one_u), up_even))
    k = e - g.emax
    if up is not None:
        k = k + ops.int32(up)
    k = ops.select(ops.eq(amax.sig, 0), -127, k)
    return ops.clamp_int(k, -127, 127)


def nvfp4_global(ops, amax: Num) -> Num:
    """float32(amax / 2688) rounded once (saturating), 2^-149 if that is 0, 1 if amax is 0."""
    d = Num(amax.neg, ops.uint(21, amax.sig), ops.int32_scalar(7), amax.nan, amax.inf)  # 2688 = 21 * 2^7
    g = round_to_grid(ops, divide(ops, amax, d, 28), FP32_SATURATING, NEAREST, None)
    tiny = ops.eq(g.sig, 0)
    g = Num(g.neg, ops.select(tiny, 1, g.sig), ops.select(tiny, -149, g.exp), g.nan, g.inf)
    zero = ops.eq(amax.sig, 0)
    return Num(g.neg, ops.select(zero, 1, g.sig), ops.select(zero, 0, g.exp), g.nan, g.inf)


def nvfp4_global_of_bits(ops, abs_bits, inf_bits, dtype, u) -> Num:
    """``nvfp4_global`` of the finite ``|x|`` bit patterns ``abs_bits`` (of ``dtype``)."""
    finite = ops.select(abs_bits >= inf_bits, 0, abs_bits)
    return nvfp4_global(ops, decompose_bits(ops, ops.max_all(finite), dtype, u))


def nvfp4_scales(ops, amax: Num, g: Num, bf) -> Num:
    """The e4m3 block scales ``amax / (6 g)`` rounded once (saturating), per block."""
    unit = Num(g.neg, g.sig * 3, g.exp + 1, g.nan, g.inf)  # 6 * g, exact
    q = divide(ops, amax, broadcast(ops, unit, ops.shape(amax.sig)), bf.scale.mbits + 5)
    return round_to_grid(ops, q, Grid.of(bf.scale, True), NEAREST, None)


def block_amax(ops, bits, axes: tuple[int, ...], shape: tuple[int, ...]):
    """Max of the ``|x|`` bit patterns over each block (zero padded), in the scales' layout."""
    nd, nb = ops.rank(bits), len(axes)
    lead = nd - nb
    moved = ops.moveaxis(bits, axes, tuple(range(lead, nd)))
    dims = ops.dims(moved)
    sizes = dims[lead:]
    counts = [(n + b - 1) // b for n, b in zip(sizes, shape)]
    split = list(dims[:lead])
    for c, b in zip(counts, shape):
        split += [c, b]
    padded = ops.zero_pad_end(moved, [0] * lead + [c * b - n for n, b, c in zip(sizes, shape, counts)])
    amax = ops.amax(ops.reshape(padded, split), tuple(lead + 2 * i + 1 for i in range(nb)))
    return ops.moveaxis(amax, tuple(range(lead, nd)), axes)
