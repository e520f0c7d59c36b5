"""The doctor's TensorFlow binning: ``histogram(t)``, ``ratio_histogram(update, weight)`` -> LogHistogram.

Binning (``histogram``, ``ratio_histogram``) is one ``tf.function`` per dtype on the tensor's device; only
counts (at most ``N_BINS + 3``) and three scalars reach the host. TensorFlow has no frexp, and its CPU
kernels flush subnormal float inputs to zero, so everything is integer arithmetic on the bits. A float32
(fp16, bf16 widened exactly) is read as uint32 bits ``u``: ``u >> 19`` is ``4096 * sign + SUB * biased
exponent + k``, the spec's index less a constant for a normal float, and one ``bincount`` over it counts
all but zeros and subnormals (exponent 0: re-binned from ``float(|bits|)``, an exact integer conversion,
which also counts the zeros) and inf/NaN (the top keys). The extremes are ``max(max x, -min x)`` and ``min
|x|`` when every element is normal, else masked integer reductions of the magnitudes' bits. float64 takes
the same steps on int64 bits (its subnormals all fall below bin 1). An update ratio ``|u| / 2^b(w)`` of
normal float32 ``u``, ``w`` is ``d = a(u) - (a(w) & 0x7f800000) = (b(u) - b(w)) * 2^23 + mantissa(u)``:
``d >> 19`` is its index less a constant, and ``min d``, ``max d`` give the extremes exactly. Elements
with a zero, subnormal, inf or NaN ``u`` or ``w`` (and float64 tensors) take the same arithmetic on
float64 bits (int64; a subnormal normalised through ``float(mantissa)``), on those elements only; its
extremes come back as ``clip(E) * 2^52 + mantissa`` and ``np.ldexp`` rounds them as the core does. The
results equal ``LogHistogram.of(t.numpy())`` and ``update_ratio_histogram(u.numpy(), w.numpy())``
exactly.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from ..doctor.histogram import B_MIN, N_BINS, SUB, LogHistogram
from ..errors import PolyampError

_MASK, _INF, _NORMAL = 0x7FFFFFFF, 0x7F800000, 0x00800000
_SHIFT = 23 - (SUB.bit_length() - 1)  # a >> _SHIFT = SUB * biased exponent + k (SUB a power of two)
_OFFSET = SUB * (-127 - B_MIN) + 1  # spec index - key, for a normal float32
_KEYS, _KEY_NORMAL, _KEY_INF = (_MASK >> _SHIFT) + 1, _NORMAL >> _SHIFT, _INF >> _SHIFT
_SUB_KEY = SUB * -B_MIN - _OFFSET  # spec index of a subnormal a: key(float(a)) - _SUB_KEY
_SUB_BINS = SUB * 23 + 1  # a subnormal's index is 1..SUB*23; bin 0 counts the zeros
# ratios: d >> _SHIFT lies in [-SUB * 253, SUB * 254) for normal u, w; its spec index is that + SUB * -B_MIN
# + 1. Shifted as uint32, a negative one comes out _RKEYS higher.
_RKEYS = 1 << (32 - _SHIFT)
_RATIO_INDEX = np.clip((np.arange(_RKEYS) + _RKEYS // 2) % _RKEYS - _RKEYS // 2 + SUB * -B_MIN + 1, 0,
                       N_BINS - 1).astype(np.int32)  # fmt: skip
# float64: exponent field 11 bits, mantissa 52
_MASK64, _INF64, _NORMAL64, _MANT64 = 2**63 - 1, 0x7FF << 52, 1 << 52, (1 << 52) - 1
_KEY64_OFFSET = SUB * (1023 + B_MIN) - 1  # spec index = (a >> 48) - this, for a normal float64
_E_CLIP = 1100  # |b(u) - b(w)| beyond this: 2^that over- or underflows float64 either way
_F64 = np.finfo(np.float64)


def histogram(t) -> LogHistogram:
    """The ``LogHistogram`` of a floating TensorFlow tensor (or variable), binned on its device."""
    x = tf.reshape(tf.convert_to_tensor(t), [-1])
    if not x.dtype.is_floating or x.dtype.is_complex:
        raise PolyampError(f"cannot bin a {x.dtype.name} tensor; accepted: floating-point dtypes (real)")
    if x.shape[0] == 0:
        return _empty()
    if x.dtype == tf.float64:
        return _decode64(*_HIST64(x))
    keys, sub, lo, hi = (r.numpy() for r in _HIST32(tf.cast(x, tf.float32)))
    counts = np.zeros(N_BINS, np.int64)
    counts[_KEY_NORMAL + _OFFSET : _KEY_INF + _OFFSET] = keys[_KEY_NORMAL:_KEY_INF]
    counts[1:_SUB_BINS] += sub[1:]
    lo, hi = int(lo), int(hi)
    return LogHistogram.from_counts(
        counts,
        zeros=int(sub[0]),
        nonfinite=int(keys[_KEY_INF:].sum()),
        amax=_float32(hi) if hi > 0 else 0.0,
        amin_nonzero=_float32(lo) if 0 < lo < _INF else None,
    )


def ratio_histogram(update, weight) -> LogHistogram:
    """``update_ratio_histogram(update, weight)`` of the core, binned on the tensors' device."""
    u = tf.reshape(tf.convert_to_tensor(update), [-1])
    w = tf.reshape(tf.convert_to_tensor(weight), [-1])
    if u.shape != w.shape:
        raise PolyampError(f"update shape {tuple(update.shape)} differs from weight's {tuple(weight.shape)}")
    for t in (u, w):
        if not t.dtype.is_floating or t.dtype.is_complex:
            raise PolyampError(f"cannot bin a {t.dtype.name} tensor; accepted: floating-point dtypes (real)")
    if u.shape[0] == 0:
        return _empty()
    if tf.float64 in (u.dtype, w.dtype):
        return _decode_general(*(r.numpy() for r in _RATIO64(_bits64(u), _bits64(w))))
    counts, dlo, dhi, general, glo, ghi = (r.numpy() for r in _RATIO32(tf.cast(u, tf.float32),
                                                                      tf.cast(w, tf.float32)))  # fmt: skip
    counts = counts.astype(np.int64)
    if counts.any():
        regular = LogHistogram.from_counts(counts, 0, 0, _ratio_value(int(dhi)), _ratio_value(int(dlo)))
    else:
        regular = _empty()
    if not general.any():
        return regular
    return regular.merge(_decode_general(general, glo, ghi))


def _empty() -> LogHistogram:
    return LogHistogram.from_counts(np.zeros(N_BINS, np.int64), 0, 0, 0.0)


def _float32(bits: int) -> float:
    return float(np.array(bits, np.int32).view(np.float32))


def _ratio_value(d: int) -> float:
    """|u| / 2^b(w) from d = (b(u) - b(w)) * 2^23 + mantissa(u): exact in float64."""
    return math.ldexp(1.0 + (d & 0x7FFFFF) / 2.0**23, d >> 23)


def _decode64(counts, lo, hi) -> LogHistogram:
    counts, lo, hi = counts.numpy().astype(np.int64), int(lo), int(hi)
    return LogHistogram.from_counts(
        counts[:N_BINS],
        zeros=int(counts[N_BINS]),
        nonfinite=int(counts[N_BINS + 1]),
        amax=float(np.array(hi, np.int64).view(np.float64)) if hi > 0 else 0.0,
        amin_nonzero=float(np.array(lo, np.int64).view(np.float64)) if 0 < lo < _INF64 else None,
    )


def _decode_general(counts, lo, hi) -> LogHistogram:
    """The float64 ratio path's counts (bins, nonfinite, apart, zeros) and the extremes' keys
    ``E * 2^52 + mantissa(u)`` (E = b(u) - b(w), clipped): ``np.ldexp`` rounds as the core does."""
    counts = np.asarray(counts).astype(np.int64)
    amax, amin = 0.0, None
    if counts[:N_BINS].any():
        with np.errstate(over="ignore", under="ignore"):
            rmax, rmin = (np.ldexp((1.0 + (int(k) & _MANT64) * 2.0**-52) / 2, (int(k) >> 52) + 1)
                          for k in (hi, lo))  # fmt: skip
        amax = float(min(rmax, _F64.max))
        amin = float(rmin) if rmin > 0 else None
    return LogHistogram.from_counts(counts[:N_BINS], zeros=int(counts[N_BINS + 2]),
                                    nonfinite=int(counts[N_BINS]), amax=amax, amin_nonzero=amin,
                                    apart=int(counts[N_BINS + 1]))  # fmt: skip


def _i64(v: int):
    return tf.constant(v, tf.int64)


def _shr(x, n: int):
    return tf.bitwise.right_shift(x, tf.constant(n, x.dtype))


def _and(x, mask: int):
    return tf.bitwise.bitwise_and(x, tf.constant(mask, x.dtype))


def _bits32(x):
    return _and(tf.bitcast(x, tf.int32), _MASK)


def _hist32(x):
    """Keys' counts (4096), subnormal and zero counts (``_SUB_BINS``), smallest non-zero and largest
    finite magnitude's bits (module docstring)."""
    both = tf.math.bincount(tf.bitcast(_shr(tf.bitcast(x, tf.uint32), _SHIFT), tf.int32),
                            minlength=2 * _KEYS, maxlength=2 * _KEYS)  # fmt: skip
    counts = both[:_KEYS] + both[_KEYS:]
    special = tf.reduce_sum(counts[:_KEY_NORMAL]) + tf.reduce_sum(counts[_KEY_INF:]) > 0

    def normal():  # every element normal and finite
        hi = tf.maximum(tf.reduce_max(x), -tf.reduce_min(x))
        lo = tf.reduce_min(tf.abs(x))
        return tf.zeros([_SUB_BINS], tf.int32), tf.bitcast(lo, tf.int32), tf.bitcast(hi, tf.int32)

    def other():
        a = _bits32(x)
        lo = tf.reduce_min(tf.where(a > 0, a, _MASK))
        hi = tf.reduce_max(tf.where(a < _INF, a, -1))
        tiny = tf.boolean_mask(a, a < _NORMAL)  # zeros and subnormals: a * 2^-149, a < 2^23 exact in float32
        key = _shr(tf.bitcast(tf.cast(tiny, tf.float32), tf.int32), _SHIFT) - _SUB_KEY
        sub = tf.math.bincount(tf.where(tiny > 0, key, 0), minlength=_SUB_BINS, maxlength=_SUB_BINS)
        return sub, lo, hi

    sub, lo, hi = tf.cond(special, other, normal)
    return counts, sub, lo, hi


def _hist64(x):
    """Bin counts, zeros and nonfinite (``N_BINS + 2``), smallest non-zero and largest finite bits."""
    a = _and(tf.bitcast(x, tf.int64), _MASK64)
    finite = a < _INF64
    idx = tf.clip_by_value(_shr(a, 48) - _KEY64_OFFSET, 0, N_BINS - 1)
    code = tf.where(a == 0, _i64(N_BINS), tf.where(finite, idx, _i64(N_BINS + 1)))
    counts = tf.math.bincount(code, minlength=N_BINS + 2, maxlength=N_BINS + 2)
    lo = tf.reduce_min(tf.where(a > 0, a, _i64(_MASK64)))
    hi = tf.reduce_max(tf.where(finite, a, _i64(-1)))
    return counts, lo, hi


def _ratio32(u, w):
    """Regular elements (normal u, w): bin counts (by ``d >> 19``), min and max d; the others:
    ``_ratio64``'s outputs for them (empty when none)."""
    au, ew = _bits32(u), _and(tf.bitcast(w, tf.int32), _INF)  # |u|'s bits, 2^b(w)'s bits
    d = au - ew
    keys = tf.bitcast(_shr(tf.bitcast(d, tf.uint32), _SHIFT), tf.int32)  # d >> 19 modulo 2^13
    regular = ((tf.reduce_min(au) >= _NORMAL) & (tf.reduce_max(au) < _INF)
               & (tf.reduce_min(ew) > 0) & (tf.reduce_max(ew) < _INF))  # fmt: skip

    def all_regular():
        counts = tf.math.bincount(keys, minlength=_RKEYS, maxlength=_RKEYS)
        return counts, tf.reduce_min(d), tf.reduce_max(d), tf.zeros([N_BINS + 3], tf.int64), _i64(0), _i64(0)

    def some_special():
        aw = _bits32(w)
        odd = (au < _NORMAL) | (au >= _INF) | (aw < _NORMAL) | (aw >= _INF)
        counts = tf.math.bincount(tf.where(odd, _RKEYS, keys), minlength=_RKEYS + 1, maxlength=_RKEYS + 1)
        lo = tf.reduce_min(tf.where(odd, tf.int32.max, d))
        hi = tf.reduce_max(tf.where(odd, tf.int32.min, d))
        return (counts[:_RKEYS], lo, hi,
                *_ratio64(_widen(tf.boolean_mask(au, odd)), _widen(tf.boolean_mask(aw, odd))))  # fmt: skip

    counts, *rest = tf.cond(regular, all_regular, some_special)
    return (tf.math.unsorted_segment_sum(counts, _RATIO_INDEX, N_BINS), *rest)  # keys to the spec's bins


def _widen(a):
    """float32 magnitude bits (int32) -> the same values' float64 bits (int64), exactly; subnormals
    through an integer-to-float conversion (TensorFlow's CPU kernels flush subnormal float inputs)."""
    a = tf.cast(a, tf.int64)
    e = _shr(a, 23)
    e = tf.where(e == 255, _i64(2047), e + (1023 - 127))
    wide = tf.bitwise.bitwise_or(e * (1 << 52), _and(a, 0x7FFFFF) * (1 << 29))
    tiny = tf.bitcast(tf.cast(a, tf.float64), tf.int64) - (149 << 52)  # a * 2^-149, a < 2^23
    return tf.where(a >= _NORMAL, wide, tf.where(a == 0, _i64(0), tiny))


def _ratio64(au, aw):
    """The ratio spec in int64 arithmetic on float64 magnitude bits: counts (bins, then nonfinite, apart,
    zeros) and min and max of ``clip(E) * 2^52 + mantissa(u)`` over the regular elements."""
    bad = (au >= _INF64) | (aw >= _INF64)
    apart = ~bad & (aw == 0)
    zero = ~bad & ~apart & (au == 0)
    regular = ~(bad | apart | zero)
    nu, nw = _normalised64(au), _normalised64(aw)
    e = _shr(nu, 52) - _shr(nw, 52)  # b(u) - b(w)
    idx = tf.clip_by_value(SUB * (e - B_MIN) + _and(_shr(nu, 48), SUB - 1) + 1, 0, N_BINS - 1)
    code = tf.where(apart, _i64(N_BINS + 1), tf.where(zero, _i64(N_BINS + 2), idx))
    counts = tf.math.bincount(tf.where(bad, _i64(N_BINS), code), minlength=N_BINS + 3, maxlength=N_BINS + 3,
                              dtype=tf.int64)  # fmt: skip
    key = tf.clip_by_value(e, -_E_CLIP, _E_CLIP) * (1 << 52) + _and(nu, _MANT64)
    lo = tf.reduce_min(tf.where(regular, key, _i64(tf.int64.max)))
    hi = tf.reduce_max(tf.where(regular, key, _i64(tf.int64.min)))
    return counts, lo, hi


def _normalised64(a):
    """float64 magnitude bits, a subnormal ``m * 2^-1074`` as ``float(m)``'s bits with the exponent
    lowered by 1074 (may go negative; exact)."""
    return tf.where(a < _NORMAL64, tf.bitcast(tf.cast(a, tf.float64), tf.int64) - (1074 << 52), a)


def _bits64(t):
    """A floating tensor's magnitudes as float64 bits (int64)."""
    if t.dtype == tf.float64:
        return _and(tf.bitcast(t, tf.int64), _MASK64)
    return _WIDEN(_bits32(tf.cast(t, tf.float32)))


_HIST32 = tf.function(_hist32, input_signature=[tf.TensorSpec([None], tf.float32)])
_HIST64 = tf.function(_hist64, input_signature=[tf.TensorSpec([None], tf.float64)])
_RATIO32 = tf.function(_ratio32, input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
_RATIO64 = tf.function(_ratio64, input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
_WIDEN = tf.function(_widen, input_signature=[tf.TensorSpec([None], tf.int32)])
