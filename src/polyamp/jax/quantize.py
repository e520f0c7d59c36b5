"""``quantize`` and ``quantize_blocks`` on JAX arrays, in JAX integer ops, bit-identical to the core.

``polyamp.quantize`` / ``polyamp.quantize_blocks`` call these for a JAX array (or tracer); they take
the same arguments and give the same values, bits and result dtype as ``polyamp.numerics.rounding``
/ ``blocks`` (read those docstrings for the rules). Everything traces: no Python branch depends on
the data, so both work under ``jax.jit`` on any device.

Why integers: float64 is off in JAX by default, and XLA's CPU backend flushes float32 subnormals to
zero (``1e-40 * 1.0 == 0`` there), so float arithmetic cannot reproduce the core. Every value is
handled as an exact ``_Num``, ``(-1)^neg * sig * 2^exp`` with an unsigned integer ``sig``
(uint32; uint64 for float64 input, which exists only with ``jax_enable_x64``):

1. decompose the input's bit pattern (float16, bfloat16, float32, float64) into ``sig, exp``;
2. ``_round`` is the core's algorithm on it: ``e = exp + msb(sig)`` clamped to ``[emin, emax + 1]``,
   spacing ``2^qe`` with ``qe = e - mbits``; drop ``s = qe - exp`` low bits of ``sig``; nearest adds
   one when the dropped bits exceed half (ties to the even integer), toward zero drops them,
   stochastic adds one when ``u < rem / 2^s``, compared exactly as ``u * 2^(53 + s) < rem * 2^53``
   in integers, ``u`` being the core's splitmix64 stream of (seed, flat index + 1) computed in uint32
   pairs (16-bit limbs for the 64-bit products); then overflow, inf, NaN, -0, unsigned and zero-less
   formats exactly as ``rounding._quantize_numpy``;
3. compose the result's bit pattern in the result dtype (NaN is the canonical quiet NaN, signed
   as the core's ``copysign`` leaves it).

Block formats of float32 or narrower input run in float64 XLA ops under a scoped ``jax.enable_x64``
(``blocks64.py``: several times faster, same bits); float64 input (x64 on) runs here, in integers:
block amax as the max of the ``|x|`` bit patterns (zero padded; a NaN or inf block has the largest
pattern and becomes NaN); MX scale exponents from the amax's exponent and top-aligned significand;
the element quotient ``x / 2^k`` is an exponent shift. NVFP4's quotients (``amax / 2688``,
``amax_block / (6 g)``, ``x / (s_block g)``) are integer long divisions keeping enough quotient bits
plus a sticky bit (round to odd), so one rounding of them equals rounding the exact quotient, which
is what the core's float64 division gives (its docstring proves it); with stochastic rounding the
core's float64 quotient itself is reproduced (a 57-bit long division rounded to 53 bits) and drawn
against. The per-block scales of ``blocks64.py`` come from here. Limits: at most 2^32 - 1 elements per
call (the stream's counter is uint32); ``seed=None`` draws the seed when the function is traced, so a
jitted function reuses it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from ..errors import PolyampError
from ..numerics.formats import FORMATS
from ..numerics.grid import FLOAT64 as _FLOAT64
from ..numerics.grid import Grid as _Grid
from ..numerics.rounding import _MODE, INPUT_DTYPES, _result_dtype
from ..numerics.rounding import arguments as _arguments
from ..numerics.stream import GOLDEN, M1, M2
from ..numerics.stream import mix as _mix

# float dtype -> (exponent bits, mantissa bits)
_LAYOUT = {np.dtype(np.float16): (5, 10), np.dtype(ml_dtypes.bfloat16): (8, 7),
           np.dtype(np.float32): (8, 23), np.dtype(np.float64): (11, 52)}  # fmt: skip
_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
_NEAREST, _STOCHASTIC, _TOWARD_ZERO = _MODE["nearest"], _MODE["stochastic"], _MODE["toward_zero"]


def accepts(x) -> bool:
    """Whether ``x`` is an array this module quantizes (the core's dispatch asks)."""
    return isinstance(x, jax.Array)


def quantize(x, fmt, rounding: str = "nearest", saturate: bool = False, seed: int | None = None):
    """``polyamp.quantize`` for a JAX array: same values, bits and dtype rule, as JAX ops."""
    fmt, mode, saturate, seed = _arguments(fmt, rounding, saturate, seed)
    x = _input(x, "quantize")
    _check_size(x, mode)
    grid = _Grid.of(fmt, saturate).arrays()
    return _quantize(x, _key(seed), grid, mode=mode, dtype=_result_dtype(np.dtype(x.dtype), fmt).name)


@functools.partial(jax.jit, static_argnames=("mode", "dtype"))
def _quantize(x, key, grid, *, mode, dtype):
    stream = _Stream(key, x.shape) if mode == _STOCHASTIC else None
    return _compose(_round(_decompose(x), grid, mode, stream), np.dtype(dtype))


def _key(seed) -> tuple[jax.Array, jax.Array]:
    """The stream's key ``_mix(seed)`` as a (hi, lo) uint32 pair: a traced argument, so a new seed
    does not recompile."""
    k = _mix(seed or 0)
    return jnp.asarray(np.uint32(k >> 32)), jnp.asarray(np.uint32(k & 0xFFFFFFFF))


def _check_size(x, mode) -> None:
    if mode == _STOCHASTIC and x.size >= 1 << 32:
        raise PolyampError(f"stochastic rounding on JAX takes at most 2^32 - 1 elements, got {x.size}")


@functools.partial(jax.jit, static_argnames=("bf", "axes", "shape", "mode"))
def _blocks_values(x, key, elem, rule, *, bf, axes, shape, mode):
    """The values of ``quantize_blocks`` (arguments checked), as in ``blocks._Encoding.of``; ``bf``
    is None for MX formats (their element grid is ``elem``, their scale rule index ``rule``)."""
    wide = x.dtype == jnp.float64
    stream = _Stream(key, x.shape) if mode == _STOCHASTIC else None
    num = _decompose(x, jnp.uint64 if (wide or jax.config.jax_enable_x64) else jnp.uint32)
    abs_bits = _bits(x) & ~_sign_mask(x.dtype)
    amax_bits = _block_amax(abs_bits, axes, shape)
    inf_bits = _inf_bits(x.dtype)
    bad = amax_bits >= inf_bits  # a NaN or inf block: NaN values, elements computed from 0
    amax = _decompose(
        lax.bitcast_convert_type(jnp.where(bad, 0, amax_bits).astype(abs_bits.dtype), x.dtype), num.sig.dtype
    )
    num = _Num(num.neg, jnp.where(_expand(bad, axes, shape, x.shape), 0, num.sig).astype(num.sig.dtype),
               num.exp, jnp.zeros_like(num.nan), jnp.zeros_like(num.inf))  # fmt: skip
    if bf is None:
        k = _mx_exponent(amax, elem, rule)
        kx = _expand(k, axes, shape, x.shape)
        e = _round(num._replace(exp=num.exp - kx), elem, mode, stream)
        value = e._replace(exp=e.exp + kx)
    else:
        finite = jnp.where(abs_bits >= inf_bits, 0, abs_bits).astype(abs_bits.dtype)
        gmax = lax.bitcast_convert_type(jnp.max(finite, initial=0), x.dtype)
        g = _nvfp4_global(_decompose(gmax, num.sig.dtype))
        unit = _Num(g.neg, g.sig * 3, g.exp + 1, g.nan, g.inf)  # 6 * g, exact
        s = _round(_divide(amax, _broadcast(unit, amax.sig.shape), bf.scale.mbits + 5),
                   _Grid.of(bf.scale, True), _NEAREST, None)  # fmt: skip
        sx = _Num(*(_expand(f, axes, shape, x.shape) for f in s))
        den_sig = sx.sig * g.sig
        zero = den_sig == 0  # s_block rounded to 0: the block holds +-0
        den = _Num(sx.neg, jnp.where(zero, 1, den_sig).astype(den_sig.dtype), sx.exp + g.exp, sx.nan, sx.inf)
        num = num._replace(sig=jnp.where(zero, 0, num.sig).astype(num.sig.dtype))
        if mode == _STOCHASTIC:  # the core draws against the float64 quotient: make it, then round
            t = _round(_divide(num, den, 57), _FLOAT64, _NEAREST, None)
            e = _round(t, elem, mode, stream)
        else:
            e = _round(_divide(num, den, bf.element.mbits + 5), elem, mode, None)
        value = _Num(e.neg, e.sig * sx.sig * g.sig, e.exp + sx.exp + g.exp, e.nan, e.inf)
        if not wide:  # the core's float64 product is exact; its cast to float32 rounds once
            value = _round(value, _Grid.of(FORMATS["fp32"], False), _NEAREST, None)
    bad_x = _expand(bad, axes, shape, x.shape)
    value = _Num(value.neg & ~bad_x, value.sig, value.exp, value.nan | bad_x, value.inf & ~bad_x)
    return _compose(value, np.dtype(np.float64 if wide else np.float32))


# -- exact numbers -----------------------------------------------------------------------------------
class _Num(NamedTuple):
    """``(-1)^neg * sig * 2^exp`` (sig unsigned, exp int32), or NaN / inf where those flags are set."""

    neg: jax.Array
    sig: jax.Array
    exp: jax.Array
    nan: jax.Array
    inf: jax.Array


def _width(u) -> int:
    return jnp.iinfo(u.dtype).bits


def _msb(u) -> jax.Array:
    """Index of the highest set bit (int32), -1 for 0."""
    return (_width(u) - 1) - lax.clz(u).astype(jnp.int32)


def _shl(u, s) -> jax.Array:
    """``u << s`` for int32 shift amounts, 0 where s >= width (s < 0 is treated as 0)."""
    w = _width(u)
    out = u << jnp.clip(s, 0, w - 1).astype(u.dtype)
    return jnp.where(s >= w, 0, out).astype(u.dtype)


def _shr(u, s) -> jax.Array:
    """``u >> s`` (logical) for int32 shift amounts, 0 where s >= width."""
    w = _width(u)
    out = u >> jnp.clip(s, 0, w - 1).astype(u.dtype)
    return jnp.where(s >= w, 0, out).astype(u.dtype)


def _bits(x) -> jax.Array:
    return lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])


def _sign_mask(dtype) -> int:
    return np.array(1 << (np.dtype(dtype).itemsize * 8 - 1)).astype(_UINT[np.dtype(dtype).itemsize])


def _inf_bits(dtype) -> jax.Array:
    e, m = _LAYOUT[np.dtype(dtype)]
    return np.array(((1 << e) - 1) << m).astype(_UINT[np.dtype(dtype).itemsize])


def _decompose(x, u=None) -> _Num:
    """The exact value of each element of a float array (``sig`` of type ``u``; uint64 for float64,
    else uint32 by default)."""
    e, m = _LAYOUT[np.dtype(x.dtype)]
    u = u or (jnp.uint64 if x.dtype == jnp.float64 else jnp.uint32)
    b = _bits(x).astype(u)
    field = ((b >> m) & ((1 << e) - 1)).astype(jnp.int32)
    mant = b & ((1 << m) - 1)
    top = field == (1 << e) - 1
    sig = jnp.where(top, 0, jnp.where(field == 0, mant, mant | (1 << m))).astype(u)
    exp = jnp.maximum(field, 1) - ((1 << (e - 1)) - 1) - m
    return _Num((b >> (e + m)) == 1, sig, exp, top & (mant != 0), top & (mant == 0))


def _compose(num: _Num, dtype: np.dtype) -> jax.Array:
    """The bit pattern of ``num`` in ``dtype``: exact for values it holds, inf beyond its range."""
    e, m = _LAYOUT[dtype]
    bias = (1 << (e - 1)) - 1
    sig = num.sig
    p = _msb(sig)
    ve = num.exp + p
    normal_bits = jnp.where(p <= m, _shl(sig, m - p), _shr(sig, p - m)) & ((1 << m) - 1)
    normal_bits = normal_bits | (jnp.clip(ve + bias, 0, (1 << e) - 1).astype(sig.dtype) << m)
    sub_bits = _shl(sig, num.exp - (1 - bias - m))
    finite = jnp.where(ve >= 1 - bias, normal_bits, sub_bits)
    inf = num.inf | ((sig != 0) & (ve + bias >= (1 << e) - 1))
    out = jnp.where(sig == 0, 0, finite)
    out = jnp.where(inf, ((1 << e) - 1) << m, out)
    out = jnp.where(num.nan, (((1 << e) - 1) << m) | (1 << (m - 1)), out).astype(sig.dtype)
    out = out | (num.neg.astype(sig.dtype) << (e + m))
    return lax.bitcast_convert_type(out.astype(_UINT[dtype.itemsize]), dtype)


def _broadcast(num: _Num, shape) -> _Num:
    return _Num(*(jnp.broadcast_to(f, shape) for f in num))


# -- the rounding ------------------------------------------------------------------------------------
def _round(num: _Num, g: _Grid, mode: int, stream: _Stream | None) -> _Num:
    """``num`` rounded onto the grid ``g``: the steps of ``rounding._quantize_numpy`` on integers."""
    sig = num.sig
    w, u = _width(sig), sig.dtype
    nz = sig != 0
    e = num.exp + _msb(sig)  # floor(log2 |x|) where nz
    qe = jnp.clip(e, g.emin, g.emax + 1) - g.mbits
    s = qe - num.exp  # low bits to drop (< 0: exact, shift up)
    f = _shl(_shr(sig, s), -s)
    rem = sig & jnp.where(s >= w, ~jnp.zeros((), u), _shl(jnp.ones((), u), s) - 1).astype(u)
    half = _shl(jnp.ones((), u), s - 1)
    up = (s >= 1) & (s <= w) & ((rem > half) | ((rem == half) & ((f & 1) == 1)))
    nearest = (f + up).astype(u)

    def over(r):  # r * 2^qe > max
        return nz & ((e > g.emax) | ((qe == g.emax - g.mbits) & (r > g.fm)))

    over_n = over(nearest)
    if mode == _NEAREST:
        r, to_max, to_over = nearest, jnp.zeros_like(nz), over_n
    elif mode == _TOWARD_ZERO:
        r, to_max, to_over = f, over(f), jnp.zeros_like(nz)
    else:
        r = (f + stream.below(rem, s, w)).astype(u)
        over_s = over(r)
        r, to_max, to_over = r, over_s & ~over_n, over_s & over_n
    to_over = (to_over | num.inf) & ~num.nan
    ovf_max, ovf_nan = jnp.asarray(g.ovf_max), jnp.asarray(g.ovf_nan)
    to_max, to_over = to_max | (to_over & ovf_max), to_over & ~ovf_max
    fm = jnp.asarray(g.fm).astype(u)
    sig_out = jnp.where(to_max, fm, r).astype(u)
    exp_out = jnp.where(to_max, g.emax - g.mbits, qe)
    nan = num.nan | (to_over & ovf_nan)
    inf = to_over & ~ovf_nan
    zero = (sig_out == 0) & ~nan & ~inf
    neg = num.neg & ~(zero & jnp.asarray(g.pos_zero))
    negative = num.neg & ~num.nan & (nz | num.inf) & ~jnp.asarray(g.signed)  # unsigned: -> +NaN
    nan, neg = nan | negative, neg & ~negative
    # no zero (no subnormals): 0 -> +NaN, a non-zero that rounds to 0 -> +min_normal
    zero_in = ~nz & ~num.nan & ~num.inf & ~jnp.asarray(g.subnormals)
    to_min = nz & zero & ~nan & ~jnp.asarray(g.subnormals)
    sig_out = jnp.where(to_min, 1, sig_out).astype(u)
    exp_out = jnp.where(to_min, g.emin, exp_out)
    neg = neg & ~zero_in & ~to_min
    nan = nan | zero_in
    return _Num(neg, sig_out, exp_out, nan, inf)


class _Stream:
    """The core's uniform stream ``_uniform53``: splitmix64 of ``key + (i + 1) * golden`` for the
    flat index ``i``, in uint32 (hi, lo) pairs; ``u = z53 / 2^53`` with ``z53 = z >> 11``."""

    def __init__(self, key: tuple[jax.Array, jax.Array], shape) -> None:
        n = int(np.prod(shape, dtype=np.int64))
        i = (lax.iota(jnp.uint32, max(n, 1))[:n] + np.uint32(1)).reshape(shape)
        zh, zl = _mul64(jnp.zeros_like(i), i, GOLDEN)
        zh, zl = _add64(zh, zl, *key)
        for shift, mult in ((30, M1), (27, M2)):
            zh, zl = _mul64(*_xor_shr(zh, zl, shift), mult)
        zh, zl = _xor_shr(zh, zl, 31)
        self.hi = zh >> 11  # z53 = (hi, lo): 21 + 32 bits
        self.lo = (zl >> 11) | (zh << 21)

    def below(self, rem, s, w) -> jax.Array:
        """``u < rem / 2^s`` exactly (rem < 2^s), as ``z53 * 2^s < rem * 2^53``."""
        k = 53 - s
        if w == 64:
            z = (self.hi.astype(jnp.uint64) << 32) | self.lo.astype(jnp.uint64)
            small = z < _shl(rem, k)
            large = (rem > 0) & (z <= _shr(rem - 1, -k))
            return jnp.where(s <= 53, small, large)
        t_hi = jnp.where(k >= 32, _shl(rem, k - 32), _shr(rem, 32 - k)).astype(jnp.uint32)
        t_hi = jnp.where(k == 0, 0, t_hi).astype(jnp.uint32)
        t_lo = _shl(rem, k)
        small = (self.hi < t_hi) | ((self.hi == t_hi) & (self.lo < t_lo))
        large = (rem > 0) & (self.hi == 0) & (self.lo <= _shr(rem - 1, -k))
        return jnp.where(s <= 53, small, large)


def _mul32(a, b: int):
    """The 64-bit product of uint32 ``a`` and the constant ``b`` as (hi, lo), in 16-bit limbs."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + (p00 >> 16)
    mid2 = p10 + (mid & 0xFFFF)
    return p11 + (mid >> 16) + (mid2 >> 16), (mid2 << 16) | (p00 & 0xFFFF)


def _mul64(hi, lo, b: int):
    """``(hi, lo) * b mod 2^64`` for a 64-bit constant ``b``."""
    ph, pl = _mul32(lo, b & 0xFFFFFFFF)
    return ph + lo * np.uint32(b >> 32) + hi * np.uint32(b & 0xFFFFFFFF), pl


def _add64(hi, lo, b_hi, b_lo):
    out = lo + b_lo
    return hi + b_hi + (out < lo).astype(jnp.uint32), out


def _xor_shr(hi, lo, k: int):
    """``z ^ (z >> k)`` for 0 < k < 32."""
    return hi ^ (hi >> k), lo ^ ((lo >> k) | (hi << (32 - k)))


def _divide(n: _Num, d: _Num, bits: int) -> _Num:
    """``n / d`` (d > 0) as ``bits`` quotient bits plus a sticky bit: long division of the operands'
    significands top-aligned at bit w - 3, so the quotient is >= 2^(bits - 2) and rounding it to
    fewer than bits - 2 significant bits rounds the exact quotient (round to odd)."""
    w = _width(n.sig)
    top = w - 3
    pn, pd = _msb(n.sig), _msb(d.sig)
    r = _shl(n.sig, top - pn)
    dd = _shl(d.sig, top - pd)
    q = jnp.zeros_like(r)
    for _ in range(bits):
        bit = r >= dd
        r = jnp.where(bit, r - dd, r)
        q = (q << 1) | bit.astype(q.dtype)
        r = r << 1
    sig = (q << 1) | (r != 0).astype(q.dtype)
    exp = (n.exp - (top - pn)) - (d.exp - (top - pd)) - bits
    return _Num(n.neg ^ d.neg, sig, exp, n.nan, n.inf)


# -- block formats -------------------------------------------------------------------------------------
def _mx_exponent(amax: _Num, g: _Grid, rule) -> jax.Array:
    """The E8M0 exponent per block (``blocks._mx_exponent``) for the element grid ``g`` and the index
    ``rule`` of ``SCALE_RULES``, from the amax's exponent and its significand top-aligned at bit
    w - 2: rceil compares it with Fmax's, ceil with 2^e's, even with (2 - 2^-(m+1)) * 2^e."""
    w = _width(amax.sig)
    u = amax.sig.dtype
    p = _msb(amax.sig)
    e = amax.exp + p
    top = _shl(amax.sig, (w - 2) - p)
    one = jnp.asarray(1 << (w - 2), u)
    fmax = _shl(jnp.asarray(g.fm).astype(u), (w - 2) - jnp.asarray(g.mbits))
    even = 2 * one - _shr(one, jnp.asarray(g.mbits) + 1)
    # nested wheres, not jnp.select: its argmax breaks lowering under a scoped jax.enable_x64 in a jit
    up = jnp.where(rule == 1, top > fmax, jnp.where(rule == 2, top != one, (rule == 3) & (top >= even)))
    k = e - g.emax + up.astype(jnp.int32)
    k = jnp.where(amax.sig == 0, -127, k)
    return jnp.clip(k, -127, 127).astype(jnp.int32)


def _nvfp4_global(amax: _Num) -> _Num:
    """float32(amax / 2688) rounded once (saturating), 2^-149 if that is 0, 1 if amax is 0."""
    u = amax.sig.dtype
    q = _divide(amax, _Num(amax.neg, jnp.asarray(21, u), jnp.asarray(7, jnp.int32), amax.nan, amax.inf), 28)
    g = _round(q, _Grid.of(FORMATS["fp32"], True), _NEAREST, None)
    tiny = g.sig == 0
    g = _Num(g.neg, jnp.where(tiny, 1, g.sig).astype(u), jnp.where(tiny, -149, g.exp), g.nan, g.inf)
    zero = amax.sig == 0
    return _Num(g.neg, jnp.where(zero, 1, g.sig).astype(u), jnp.where(zero, 0, g.exp), g.nan, g.inf)


def _blocked(a, axes, shape):
    """``a`` with the blocked axes moved last, zero padded and split into (count, block) pairs."""
    nd = a.ndim
    moved = jnp.moveaxis(a, axes, range(nd - len(axes), nd))
    lead = moved.shape[: nd - len(axes)]
    sizes = moved.shape[nd - len(axes) :]
    counts = [-(-n // b) for n, b in zip(sizes, shape)]
    pad = [(0, 0)] * len(lead) + [(0, c * b - n) for n, b, c in zip(sizes, shape, counts)]
    moved = jnp.pad(moved, pad)
    split = list(lead)
    for c, b in zip(counts, shape):
        split += [c, b]
    return moved.reshape(split), len(lead)


def _block_amax(bits, axes, shape):
    """Max of the |x| bit patterns over each block, in the scales' layout."""
    blocked, lead = _blocked(bits, axes, shape)
    amax = jnp.max(blocked, axis=tuple(lead + 2 * i + 1 for i in range(len(shape))), initial=0)
    return jnp.moveaxis(amax, range(bits.ndim - len(axes), bits.ndim), axes)


def _expand(per_block, axes, shape, full):
    """Repeat each block's entry over its elements: the scales' layout -> x's layout."""
    out = per_block
    for a, b in zip(axes, shape):
        out = jnp.repeat(out, b, axis=a, total_repeat_length=out.shape[a] * b)
        out = lax.slice_in_dim(out, 0, full[a], axis=a)
    return out


# -- argument checking ---------------------------------------------------------------------------------
def _input(x, name: str):
    if not isinstance(x, jax.Array):
        raise PolyampError(f"polyamp.jax.quantize.{name} takes a JAX array, got {type(x).__name__}")
    if np.dtype(x.dtype) not in INPUT_DTYPES:
        raise PolyampError(
            f"expected a floating-point array, got dtype {x.dtype}; accepted: "
            + ", ".join(str(d) for d in INPUT_DTYPES)
        )
    return x


__all__ = ["accepts", "quantize"]
