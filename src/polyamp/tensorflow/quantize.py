"""``quantize`` and ``quantize_blocks`` on TensorFlow tensors, in integer TF ops, bit-identical to the core.

``polyamp.quantize`` / ``polyamp.quantize_blocks`` call these for a ``tf.Tensor`` or ``tf.Variable``;
they take the same arguments and give the same values, bits and result dtype as
``polyamp.numerics.rounding`` / ``blocks`` (read those docstrings for the rules). Every step is a TF
op with no Python branch on the data, so both run eagerly, inside ``tf.function`` and under
``jit_compile=True`` alike.

Why integers: eager TensorFlow on the CPU flushes float32 subnormals (inputs and results: ``1e-40 *
1.0 == 0`` and ``reduce_max(abs(1e-40)) == 0`` there) while ``tf.function`` does not, so float
arithmetic cannot reproduce the core. The algorithm is ``polyamp/jax/quantize.py``'s, on uint64:

1. decompose the input's bit pattern (float16, bfloat16, float32, float64) into an exact ``_Num``,
   ``(-1)^neg * sig * 2^exp``;
2. ``_round`` is the core's algorithm on it: ``e = exp + msb(sig)`` clamped to ``[emin, emax + 1]``,
   spacing ``2^qe`` with ``qe = e - mbits``; drop ``s = qe - exp`` low bits; nearest adds one when
   the dropped bits exceed half (ties to even), toward zero drops them, stochastic adds one when
   ``u < rem / 2^s``, compared exactly as ``z53 * 2^s < rem * 2^53``, ``z53`` being the core's
   splitmix64 stream of (seed, flat index + 1) in uint64 arithmetic (which wraps mod 2^64 as the
   core's does); then overflow, inf, NaN, -0, unsigned and zero-less formats as the core;
3. compose the result's bit pattern in the result dtype (NaN is the canonical quiet NaN).

Block formats as the JAX module: amax as the max of ``|x|`` bit patterns, MX scale exponents from
it, NVFP4's quotients as long divisions with a sticky bit (round to odd: one rounding of them equals
rounding the exact quotient); NVFP4 with stochastic rounding draws against the core's float64
quotient, reproduced as a 57-bit division rounded to 53 bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from ..errors import PolyampError
from ..numerics import blocks as _blocks
from ..numerics.formats import FORMATS, FloatFormat
from ..numerics.grid import FLOAT64 as _FLOAT64
from ..numerics.grid import Grid as _Grid
from ..numerics.rounding import _MODE, _result_name
from ..numerics.rounding import arguments as _arguments
from ..numerics.stream import GOLDEN, M1, M2
from ..numerics.stream import mix as _mix

# float dtype -> (exponent bits, mantissa bits, unsigned dtype of its width)
_LAYOUT = {tf.float16: (5, 10, tf.uint16), tf.bfloat16: (8, 7, tf.uint16),
           tf.float32: (8, 23, tf.uint32), tf.float64: (11, 52, tf.uint64)}  # fmt: skip
_INPUT_NAMES = ", ".join(d.name for d in _LAYOUT)
_U, _I = tf.uint64, tf.int32
_NEAREST, _STOCHASTIC, _TOWARD_ZERO = _MODE["nearest"], _MODE["stochastic"], _MODE["toward_zero"]


def accepts(x) -> bool:
    """Whether ``x`` is a tensor this module quantizes (the core's dispatch asks)."""
    return isinstance(x, (tf.Tensor, tf.Variable))


def quantize(x, fmt, rounding: str = "nearest", saturate: bool = False, seed: int | None = None):
    """``polyamp.quantize`` for a TF tensor: same values, bits and dtype rule, as TF ops."""
    fmt, mode, saturate, seed = _arguments(fmt, rounding, saturate, seed)
    x = _input(x, "quantize")
    return quantize_keyed(x, fmt, mode, saturate, key_of(seed or 0))


def quantize_keyed(x, fmt: FloatFormat, mode: int, saturate: bool, key):
    """``quantize`` with the stream's key (``key_of(seed)``, a uint64 scalar tensor) given."""
    stream = _Stream(key, x) if mode == _STOCHASTIC else None
    out = _round(_decompose(x), _Grid.of(fmt, saturate), mode, stream)
    return compose(out, tf.as_dtype(_result_name(x.dtype.name, fmt)))


def graph_call(fn, tensors: tuple, static: tuple):
    """``fn(*tensors, *static)`` through a ``tf.function`` made once per (fn, shapes, dtypes, static):
    eagerly one graph run instead of thousands of eager ops, in a trace one call of a function traced
    once per shape (the recipe's kernels, called every step on the same shapes)."""
    signature = tuple((tuple(t.shape.as_list()), t.dtype) for t in tensors)
    return _graph(fn, signature, static)(*tensors)


@functools.lru_cache(maxsize=512)
def _graph(fn, signature, static):
    return tf.function(lambda *tensors: fn(*tensors, *static), autograph=False)


def key_of(seed):
    """The stream's key ``rounding._mix(seed)`` as a uint64 scalar: from a Python int, or (traced) from
    an integer tensor (a step counter in a ``tf.Variable``)."""
    if isinstance(seed, (int, np.integer)):
        return tf.constant(_mix(int(seed)), _U)
    z = tf.cast(seed, _U) + _c(GOLDEN)
    z = (z ^ _shr_c(z, 30)) * _c(M1)
    z = (z ^ _shr_c(z, 27)) * _c(M2)
    return z ^ _shr_c(z, 31)


def quantize_blocks(x, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                    rounding: str = "nearest", seed: int | None = None):  # fmt: skip
    """``polyamp.quantize_blocks`` for a TF tensor: same values and bits, float32 unless x is float64."""
    bf, mode, seed, rule = _blocks.arguments(fmt, scale_rule, rounding, seed)
    x = _input(x, "quantize_blocks")
    shape = _blocks._block_shape(bf, block)
    axes = _blocks._axes(axis, x.shape.rank, len(shape))
    return blocks_keyed(x, bf, axes, shape, rule, mode, key_of(seed or 0))


def blocks_keyed(x, bf, axes, shape, rule, mode, key):
    """The values of ``quantize_blocks`` (arguments checked), as in ``blocks._Encoding.of``."""
    wide = x.dtype == tf.float64
    stream = _Stream(key, x) if mode == _STOCHASTIC else None
    num = _decompose(x)
    abs_bits = tf.cast(_bits(x), _U) & _c(_sign_mask(x.dtype) - 1)
    amax_bits = _block_amax(abs_bits, axes, shape)
    inf_bits = _c(_inf_bits(x.dtype))
    bad = amax_bits >= inf_bits  # a NaN or inf block: NaN values, elements computed from 0
    amax = _decompose_bits(tf.where(bad, _c(0), amax_bits), x.dtype)
    num = _Num(num.neg, tf.where(_expand(bad, axes, shape, x), _c(0), num.sig), num.exp,
               tf.zeros_like(num.nan), tf.zeros_like(num.inf))  # fmt: skip
    elem = _Grid.of(bf.element, True)
    if bf.scale.name == "e8m0fnu":
        kx = _expand(_mx_exponent(amax, elem, rule), axes, shape, x)
        e = _round(num._replace(exp=num.exp - kx), elem, mode, stream)
        value = e._replace(exp=e.exp + kx)
    else:
        finite = tf.where(abs_bits >= inf_bits, _c(0), abs_bits)
        gmax = tf.reduce_max(tf.concat([tf.reshape(finite, [-1]), tf.zeros([1], _U)], 0))
        g = _nvfp4_global(_decompose_bits(gmax, x.dtype))
        unit = _Num(g.neg, g.sig * 3, g.exp + 1, g.nan, g.inf)  # 6 * g, exact
        s = _round(_divide(amax, _broadcast(unit, tf.shape(amax.sig)), bf.scale.mbits + 5),
                   _Grid.of(bf.scale, True), _NEAREST, None)  # fmt: skip
        sx = _Num(*(_expand(f, axes, shape, x) for f in s))
        den_sig = sx.sig * g.sig
        zero = tf.equal(den_sig, 0)  # s_block rounded to 0: the block holds +-0
        den = _Num(sx.neg, tf.where(zero, _c(1), den_sig), sx.exp + g.exp, sx.nan, sx.inf)
        num = num._replace(sig=tf.where(zero, _c(0), num.sig))
        if mode == _STOCHASTIC:  # the core draws against the float64 quotient: make it, then round
            t = _round(_divide(num, den, 57), _FLOAT64, _NEAREST, None)
            e = _round(t, elem, mode, stream)
        else:
            e = _round(_divide(num, den, bf.element.mbits + 5), elem, mode, None)
        value = _Num(e.neg, e.sig * sx.sig * g.sig, e.exp + sx.exp + g.exp, e.nan, e.inf)
        if not wide:  # the core's float64 product is exact; its cast to float32 rounds once
            value = _round(value, _Grid.of(FORMATS["fp32"], False), _NEAREST, None)
    bad_x = _expand(bad, axes, shape, x)
    value = _Num(value.neg & ~bad_x, value.sig, value.exp, value.nan | bad_x, value.inf & ~bad_x)
    return compose(value, tf.float64 if wide else tf.float32)


# -- exact numbers -----------------------------------------------------------------------------------
class _Num(NamedTuple):
    """``(-1)^neg * sig * 2^exp`` (sig uint64, exp int32), or NaN / inf where those flags are set."""

    neg: tf.Tensor
    sig: tf.Tensor
    exp: tf.Tensor
    nan: tf.Tensor
    inf: tf.Tensor


def _c(v, dtype=_U) -> tf.Tensor:
    return tf.constant(v, dtype)


def _shr_c(u, k: int) -> tf.Tensor:
    return tf.bitwise.right_shift(u, _c(k, u.dtype))


def _shl_c(u, k: int) -> tf.Tensor:
    return tf.bitwise.left_shift(u, _c(k, u.dtype))


def _shl(u, s) -> tf.Tensor:
    """``u << s`` for int32 shift amounts, 0 where s >= 64 (s < 0 is treated as 0)."""
    out = tf.bitwise.left_shift(u, tf.cast(tf.clip_by_value(s, 0, 63), _U))
    return tf.where(s >= 64, _c(0), out)


def _shr(u, s) -> tf.Tensor:
    """``u >> s`` (logical) for int32 shift amounts, 0 where s >= 64."""
    out = tf.bitwise.right_shift(u, tf.cast(tf.clip_by_value(s, 0, 63), _U))
    return tf.where(s >= 64, _c(0), out)


def _msb(u) -> tf.Tensor:
    """Index of the highest set bit of a uint64 (int32), -1 for 0 (a binary search)."""
    p, v = tf.zeros(tf.shape(u), _I), u
    for k in (32, 16, 8, 4, 2, 1):
        t = _shr_c(v, k)
        up = tf.not_equal(t, 0)
        p, v = tf.where(up, p + k, p), tf.where(up, t, v)
    return tf.where(tf.equal(u, 0), -1, p)


def _bits(x) -> tf.Tensor:
    return tf.bitcast(x, _LAYOUT[x.dtype][2])


def _sign_mask(dtype) -> int:
    e, m, _ = _LAYOUT[dtype]
    return 1 << (e + m)


def _inf_bits(dtype) -> int:
    e, m, _ = _LAYOUT[dtype]
    return ((1 << e) - 1) << m


def _decompose(x) -> _Num:
    """The exact value of each element of a float tensor."""
    return _decompose_bits(tf.cast(_bits(x), _U), x.dtype)


def _decompose_bits(b, dtype) -> _Num:
    """The exact value of float bit patterns ``b`` (uint64) of ``dtype``."""
    e, m, _ = _LAYOUT[dtype]
    field = tf.cast(_shr_c(b, m) & _c((1 << e) - 1), _I)
    mant = b & _c((1 << m) - 1)
    top = tf.equal(field, (1 << e) - 1)
    sig = tf.where(top, _c(0), tf.where(tf.equal(field, 0), mant, mant | _c(1 << m)))
    exp = tf.maximum(field, 1) - ((1 << (e - 1)) - 1) - m
    zero_mant = tf.equal(mant, 0)
    return _Num(tf.equal(_shr_c(b, e + m), 1), sig, exp, top & ~zero_mant, top & zero_mant)


def compose(num: _Num, dtype) -> tf.Tensor:
    """The bit pattern of ``num`` in ``dtype``: exact for values it holds, inf beyond its range."""
    e, m, unsigned = _LAYOUT[dtype]
    bias = (1 << (e - 1)) - 1
    sig = num.sig
    p = _msb(sig)
    ve = num.exp + p
    normal_bits = tf.where(p <= m, _shl(sig, m - p), _shr(sig, p - m)) & _c((1 << m) - 1)
    normal_bits = normal_bits | _shl_c(tf.cast(tf.clip_by_value(ve + bias, 0, (1 << e) - 1), _U), m)
    sub_bits = _shl(sig, num.exp - (1 - bias - m))
    finite = tf.where(ve >= 1 - bias, normal_bits, sub_bits)
    nz = tf.not_equal(sig, 0)
    inf = num.inf | (nz & (ve + bias >= (1 << e) - 1))
    out = tf.where(nz, finite, _c(0))
    out = tf.where(inf, _c(((1 << e) - 1) << m), out)
    out = tf.where(num.nan, _c((((1 << e) - 1) << m) | (1 << (m - 1))), out)
    out = out | _shl_c(tf.cast(num.neg, _U), e + m)
    return tf.bitcast(tf.cast(out, unsigned), dtype)


def _broadcast(num: _Num, shape) -> _Num:
    return _Num(*(tf.broadcast_to(f, shape) for f in num))


# -- the rounding ------------------------------------------------------------------------------------
def _round(num: _Num, g: _Grid, mode: int, stream: _Stream | None) -> _Num:
    """``num`` rounded onto the grid ``g``: the steps of ``rounding._quantize_numpy`` on integers."""
    sig = num.sig
    nz = tf.not_equal(sig, 0)
    e = num.exp + _msb(sig)  # floor(log2 |x|) where nz
    qe = tf.clip_by_value(e, g.emin, g.emax + 1) - g.mbits
    s = qe - num.exp  # low bits to drop (< 0: exact, shift up)
    f = _shl(_shr(sig, s), -s)
    rem = sig & tf.where(s >= 64, _c((1 << 64) - 1), _shl(_c(1), s) - _c(1))
    half = _shl(_c(1), s - 1)
    odd = tf.equal(f & _c(1), 1)
    up = (s >= 1) & (s <= 64) & ((rem > half) | (tf.equal(rem, half) & odd))
    nearest = f + tf.cast(up, _U)

    def over(r):  # r * 2^qe > max
        return nz & ((e > g.emax) | (tf.equal(qe, g.emax - g.mbits) & (r > _c(g.fm))))

    no = tf.zeros_like(nz)
    if mode == _NEAREST:
        r, to_max, to_over = nearest, no, over(nearest)
    elif mode == _TOWARD_ZERO:
        r, to_max, to_over = f, over(f), no
    else:
        over_n = over(nearest)
        r = f + tf.cast(stream.below(rem, s), _U)
        over_s = over(r)
        to_max, to_over = over_s & ~over_n, over_s & over_n
    to_over = (to_over | num.inf) & ~num.nan
    if g.ovf_max:
        to_max, to_over = to_max | to_over, no
    sig_out = tf.where(to_max, _c(g.fm), r)
    exp_out = tf.where(to_max, g.emax - g.mbits, qe)
    nan = num.nan | to_over if g.ovf_nan else num.nan
    inf = no if g.ovf_nan else to_over
    zero = tf.equal(sig_out, 0) & ~nan & ~inf
    neg = num.neg & ~zero if g.pos_zero else num.neg
    if not g.signed:  # negative input -> +NaN
        negative = num.neg & ~num.nan & (nz | num.inf)
        nan, neg = nan | negative, neg & ~negative
    if not g.subnormals:  # no zero: 0 -> +NaN, a non-zero that rounds to 0 -> +min_normal
        zero_in = ~nz & ~num.nan & ~num.inf
        to_min = nz & zero & ~nan
        sig_out = tf.where(to_min, _c(1), sig_out)
        exp_out = tf.where(to_min, g.emin, exp_out)
        neg = neg & ~zero_in & ~to_min
        nan = nan | zero_in
    return _Num(neg, sig_out, exp_out, nan, inf)


class _Stream:
    """The core's uniform stream ``_uniform53``: splitmix64 of ``key + (i + 1) * golden`` for the flat
    index ``i`` (uint64, wrapping); ``u = z53 / 2^53`` with ``z53 = z >> 11``."""

    def __init__(self, key, x) -> None:
        """The stream over ``x``'s elements (its shape may be known only when it runs)."""
        if x.shape.is_fully_defined():
            n, shape = int(np.prod(x.shape.as_list(), dtype=np.int64)), x.shape.as_list()
        else:
            shape = tf.shape(x, out_type=tf.int64)
            n = tf.reduce_prod(shape)
        i = tf.reshape(tf.cast(tf.range(1, n + 1, dtype=tf.int64), _U), shape)
        z = key + i * _c(GOLDEN)
        z = (z ^ _shr_c(z, 30)) * _c(M1)
        z = (z ^ _shr_c(z, 27)) * _c(M2)
        self.z53 = _shr_c(z ^ _shr_c(z, 31), 11)

    def below(self, rem, s) -> tf.Tensor:
        """``u < rem / 2^s`` exactly (rem < 2^s), as ``z53 * 2^s < rem * 2^53``."""
        k = 53 - s
        small = self.z53 < _shl(rem, k)
        large = tf.not_equal(rem, 0) & (self.z53 <= _shr(rem - _c(1), -k))
        return tf.where(s <= 53, small, large)


def _divide(n: _Num, d: _Num, bits: int) -> _Num:
    """``n / d`` (d > 0) as ``bits`` quotient bits plus a sticky bit: long division of the significands
    top-aligned at bit 61, so the quotient is >= 2^(bits - 2) and rounding it to fewer than bits - 2
    significant bits rounds the exact quotient (round to odd)."""
    top = 61
    pn, pd = _msb(n.sig), _msb(d.sig)
    r = _shl(n.sig, top - pn)
    dd = _shl(d.sig, top - pd)
    q = tf.zeros_like(r)
    for _ in range(bits):
        bit = r >= dd
        r = tf.where(bit, r - dd, r)
        q = _shl_c(q, 1) | tf.cast(bit, _U)
        r = _shl_c(r, 1)
    sig = _shl_c(q, 1) | tf.cast(tf.not_equal(r, 0), _U)
    exp = (n.exp - (top - pn)) - (d.exp - (top - pd)) - bits
    return _Num(tf.math.not_equal(n.neg, d.neg), sig, exp, n.nan, n.inf)


# -- block formats -------------------------------------------------------------------------------------
def _mx_exponent(amax: _Num, g: _Grid, rule: str) -> tf.Tensor:
    """The E8M0 exponent per block (``blocks._mx_exponent``) from the amax's exponent and significand
    top-aligned at bit 62: rceil compares it with Fmax's, ceil with 2^e's, even with
    (2 - 2^-(m+1)) * 2^e."""
    p = _msb(amax.sig)
    e = amax.exp + p
    top = _shl(amax.sig, 62 - p)
    one = 1 << 62
    if rule == "rceil":
        up = top > _c(g.fm << (62 - g.mbits))
    elif rule == "ceil":
        up = tf.not_equal(top, one)
    elif rule == "even":
        up = top >= _c(2 * one - (one >> (g.mbits + 1)))
    else:
        up = tf.zeros(tf.shape(top), tf.bool)
    k = e - g.emax + tf.cast(up, _I)
    k = tf.where(tf.equal(amax.sig, 0), -127, k)
    return tf.clip_by_value(k, -127, 127)


def _nvfp4_global(amax: _Num) -> _Num:
    """float32(amax / 2688) rounded once (saturating), 2^-149 if that is 0, 1 if amax is 0."""
    q = _divide(amax, _Num(amax.neg, _c(21), tf.constant(7, _I), amax.nan, amax.inf), 28)
    g = _round(q, _Grid.of(FORMATS["fp32"], True), _NEAREST, None)
    tiny = tf.equal(g.sig, 0)
    g = _Num(g.neg, tf.where(tiny, _c(1), g.sig), tf.where(tiny, -149, g.exp), g.nan, g.inf)
    zero = tf.equal(amax.sig, 0)
    return _Num(g.neg, tf.where(zero, _c(1), g.sig), tf.where(zero, 0, g.exp), g.nan, g.inf)


def _perm(nd: int, axes) -> list[int]:
    """The permutation that moves ``axes`` last, in order."""
    return [i for i in range(nd) if i not in axes] + list(axes)


def _dims(x) -> list:
    """``x``'s dimensions: Python ints where the static shape knows them, else scalar tensors (a batch
    dimension ``model.fit`` leaves open)."""
    dynamic = None if x.shape.is_fully_defined() else tf.shape(x)
    return [n if n is not None else dynamic[i] for i, n in enumerate(x.shape.as_list())]


def _block_amax(bits, axes, shape):
    """Max of the |x| bit patterns over each block, in the scales' layout."""
    nd = bits.shape.rank
    perm = _perm(nd, axes)
    moved = tf.transpose(bits, perm)
    dims = _dims(moved)
    lead, sizes = dims[: nd - len(axes)], dims[nd - len(axes) :]
    counts = [(n + b - 1) // b for n, b in zip(sizes, shape)]
    pad = [[0, 0]] * len(lead) + [[0, c * b - n] for n, b, c in zip(sizes, shape, counts)]
    split = list(lead)
    for c, b in zip(counts, shape):
        split += [c, b]
    static = all(isinstance(v, int) for v in split)
    pad, split = (pad, split) if static else (tf.stack([tf.stack(p) for p in pad]), tf.stack(split))
    blocked = tf.reshape(tf.pad(moved, pad), split)
    amax = tf.reduce_max(blocked, axis=[len(lead) + 2 * i + 1 for i in range(len(shape))])
    return tf.transpose(amax, np.argsort(perm).tolist())


def _expand(per_block, axes, shape, x):
    """Repeat each block's entry over its elements: the scales' layout -> ``x``'s layout."""
    out, full = per_block, _dims(x)
    for a, b in zip(axes, shape):
        out = tf.repeat(out, b, axis=a)
        index = [slice(None)] * out.shape.rank
        index[a] = slice(0, full[a])
        out = out[tuple(index)]
    return out


# -- argument checking ---------------------------------------------------------------------------------
def _input(x, name: str):
    if not accepts(x):
        raise PolyampError(f"polyamp.tensorflow.quantize.{name} takes a TensorFlow tensor, "
                           f"got {type(x).__name__}")  # fmt: skip
    if x.dtype not in _LAYOUT:
        raise PolyampError(
            f"expected a floating-point tensor, got dtype {x.dtype.name}; accepted: {_INPUT_NAMES}"
        )
    if not x.shape.is_fully_defined():
        raise PolyampError(f"polyamp.tensorflow.quantize.{name} needs a static shape, got {x.shape}")
    return tf.convert_to_tensor(x)


__all__ = ["accepts", "compose", "key_of", "quantize", "quantize_blocks"]
