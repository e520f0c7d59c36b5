"""The doctor's TensorFlow binning: the statistics of ``LogHistogram.of`` / ``update_ratio_histogram``,
computed on the tensors' device, exactly.

``histogram(t)`` and ``ratio_histogram(update, weight)`` bin one tensor; ``records(items)`` bins many in
the graph being traced (the doctor's traced step) and returns one int64 vector of their statistics and
where each lies in it; ``Tally`` sums records on the host into a ``LogHistogram`` (``decode`` one). Only
these counts and a few scalars per histogram reach the host.

TensorFlow has no frexp, and its CPU kernels (and XLA's) treat subnormal floats as zero, so everything is
integer arithmetic on the bits ``a = bits & 0x7fffffff`` of the magnitudes. Two kernels per statistic:
- float32 (fp16, bf16 widened exactly), for tensors of more than ``_SMALL`` elements: one XLA program
  per shape that walks the tensor in chunks of ``_CHUNK`` elements (the last one shifted back to end at
  the tensor's end, its repeated elements masked) and, per chunk, gives each element its slot: the spec's
  index ``(a >> 19) + 353`` for a normal float, that of ``float(a)`` (an exact integer conversion, ``a <
  2^23``) less 149 binades for a subnormal, or a slot of its own for zeros, inf/NaN (and, for ratios,
  zero weights); one scatter-add counts the slots and one variadic reduction (XLA on CPU vectorises it,
  unlike lone integer reductions) takes the extremes: the largest finite and smallest non-zero ``a``,
  for an update ratio ``|u| / 2^b(w)`` its key ``(b(u) - b(w)) * 2^52 + mantissa(u) * 2^29`` (a float64
  mantissa: ordered as the ratios). The chunk stays in the cache and each element is read once;
  ``u = after - before`` is computed in the same pass.
- general, on float64 bits (int64; float32 widened exactly, a subnormal normalised through
  ``float(mantissa)``), in TensorFlow ops, for float64 tensors and small ones. Many tensors are binned at
  once, each a segment of one concatenation: one bincount of ``code + segment * width``, segment minima
  and maxima (a small tensor costs more in per-op time than in passes, and a graph of many ops takes
  long to build). An update ratio's extremes come back as keys ``clip(E) * 2^52 + mantissa(u)``.
The host turns a key into ``(1 + m / 2^52) * 2^E`` with ``np.ldexp``, rounding as the core does. The
results equal ``LogHistogram.of(t.numpy())`` and ``update_ratio_histogram(u.numpy(), w.numpy())``
exactly.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as tf_xla

from ..doctor import binning as core
from ..doctor import vector
from ..doctor.histogram import N_BINS, LogHistogram
from ..errors import PolyampError
from . import xp, xp_int

_MASK, _INF, _NORMAL, _MANT = core.F32.mask, core.F32.inf, core.F32.normal, core.F32.normal - 1
_IGNORE = vector.HIGH  # the slot of the elements a chunk repeats
_RATIO_ORDER = [*range(N_BINS), vector.NONFINITE, vector.APART, vector.ZEROS]  # a ratio record's counts
_CHUNK = 1 << 18  # elements of a chunk of the float32 kernel: its slots stay in the cache
_SMALL = 1 << 14  # elements: up to this, a tensor takes the general kernel, batched with the others
# float64: exponent field 11 bits, mantissa 52
_MASK64, _INF64, _MANT64 = core.F64.mask, core.F64.inf, core.F64.normal - 1
_E_CLIP = 1100  # |b(u) - b(w)| beyond this: 2^that over- or underflows float64 either way
_F64 = np.finfo(np.float64)
_LENGTH = {"hist": N_BINS + 4, "ratio": N_BINS + 5}  # a record's, by layout


def histogram(t) -> LogHistogram:
    """The ``LogHistogram`` of a floating TensorFlow tensor (or variable), binned on its device."""
    x = _flat(t)
    if x.dtype == tf.float64 or _small(x):
        return decode("hist", _HIST64(_bits64(x))[0].numpy())
    return decode("hist", _compiled("hist", x.shape[0])(tf.cast(x, tf.float32)).numpy())


def ratio_histogram(update, weight) -> LogHistogram:
    """``update_ratio_histogram(update, weight)`` of the core, binned on the tensors' device."""
    u, w = _pair(update, weight)
    if tf.float64 in (u.dtype, w.dtype) or _small(u):
        return decode("ratio", _RATIO64(_bits64(u), _bits64(w))[0].numpy())
    record = _compiled("ratio", u.shape[0])(tf.cast(u, tf.float32), tf.cast(w, tf.float32))
    return decode("ratio", record.numpy())


def records(items: list) -> tuple[tf.Tensor, list[tuple[str, int, int]]]:
    """The statistics of many histograms as one int64 vector, for the graph being traced: ``items`` are
    floating tensors (histograms) and ``(after, before)`` pairs (the update ratio of ``after - before``
    relative to ``before``); returns the vector and, for each item, ``(layout, start, stop)`` of its
    record in it (``decode(layout, vector[start:stop])``)."""
    rows, small_h, small_r = [], [], []  # (item, layout, row); (item, tensor(s)) for the general kernel
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            after, before = _pair(*item)
            if after.dtype == before.dtype == tf.float32 and not _small(after):
                rows.append((i, "ratio", _compiled("step", after.shape[0])(after, before)))
            else:  # the update in the variable's own dtype
                small_r.append((i, (after - before, before)))
            continue
        x = _flat(item)
        if x.dtype == tf.float64 or _small(x):
            small_h.append((i, x))
        else:
            rows.append((i, "hist", _compiled("hist", x.shape[0])(tf.cast(x, tf.float32))))
    if small_h:
        (a,), seg, n = _segments([[x for _, x in small_h]])
        rows += [(i, "hist", row) for (i, _), row in zip(small_h, tf.unstack(_hist64(a, seg, n)))]
    if small_r:
        (au, aw), seg, n = _segments([[u for _, (u, _) in small_r], [w for _, (_, w) in small_r]])
        rows += [(i, "ratio", row) for (i, _), row in zip(small_r, tf.unstack(_ratio64(au, aw, seg, n)))]
    spans: list = [None] * len(items)
    start = 0
    for i, layout, _ in rows:
        spans[i] = (layout, start, start + _LENGTH[layout])
        start += _LENGTH[layout]
    return tf.concat([row for _, _, row in rows], 0), spans


def decode(layout: str, record) -> LogHistogram:
    """The ``LogHistogram`` of one record (read to the host) of the given layout."""
    return Tally().add(layout, record).histogram()


class Tally:
    """A histogram summed from records on the host (``LogHistogram.merge``'s rule, one validation at the
    end): ``add(layout, record)``, then ``histogram()``."""

    def __init__(self):
        self.counts = np.zeros(N_BINS, np.int64)
        self.zeros = self.nonfinite = self.apart = 0
        self.amax, self.amin = 0.0, math.inf

    def add(self, layout: str, record) -> Tally:
        rec = np.asarray(record).astype(np.int64)
        if layout == "hist":  # bins, zeros, nonfinite, the extremes' float64 bits
            self.zeros += int(rec[N_BINS])
            self.nonfinite += int(rec[N_BINS + 1])
            lo, hi = int(rec[N_BINS + 2]), int(rec[N_BINS + 3])
            self._bins(
                rec[:N_BINS],
                float(np.array(hi, np.int64).view(np.float64)) if hi > 0 else 0.0,
                float(np.array(lo, np.int64).view(np.float64)) if 0 < lo < _INF64 else math.inf,
            )
        elif layout == "ratio":  # bins, nonfinite, apart, zeros, the extremes' keys
            self.nonfinite += int(rec[N_BINS])
            self.apart += int(rec[N_BINS + 1])
            self.zeros += int(rec[N_BINS + 2])
            if rec[:N_BINS].any():
                with np.errstate(over="ignore", under="ignore"):
                    high, low = (np.ldexp((1.0 + (k & _MANT64) * 2.0**-52) / 2, (k >> 52) + 1)
                                 for k in (int(rec[N_BINS + 4]), int(rec[N_BINS + 3])))  # fmt: skip
                self._bins(rec[:N_BINS], float(min(high, _F64.max)), float(low) if low > 0 else math.inf)
        else:
            raise PolyampError(f"unknown record layout {layout!r}; expected one of {sorted(_LENGTH)}")
        return self

    def _bins(self, counts, amax: float, amin: float) -> None:
        self.counts += counts
        self.amax, self.amin = max(self.amax, amax), min(self.amin, amin)

    def histogram(self) -> LogHistogram:
        amin = None if self.amin == math.inf else self.amin
        return LogHistogram.from_counts(self.counts, zeros=self.zeros, nonfinite=self.nonfinite,
                                        amax=self.amax, amin_nonzero=amin, apart=self.apart)  # fmt: skip


def _flat(t):
    x = tf.reshape(tf.convert_to_tensor(t), [-1])
    if not x.dtype.is_floating or x.dtype.is_complex:
        raise PolyampError(f"cannot bin a {x.dtype.name} tensor; accepted: floating-point dtypes (real)")
    return x


def _pair(update, weight):
    u, w = _flat(update), _flat(weight)
    if u.shape != w.shape:
        raise PolyampError(f"update shape {tuple(update.shape)} differs from weight's {tuple(weight.shape)}")
    return u, w


def _small(x) -> bool:
    return x.shape[0] is None or x.shape[0] <= _SMALL


# -- the float32 kernel (XLA) -----------------------------------------------------------------------------
def _chunked(elements, arrays: list, width: int, extremes: tf.DType):
    """Slot counts (``width``) and extremes (max, min) of ``elements(*chunk)`` -> (slots, maxima keys,
    minima keys) over equal flat ``arrays``, a chunk at a time (module docstring)."""
    n = arrays[0].shape[0]
    info = extremes.as_numpy_dtype
    low, high = tf.constant(np.iinfo(info).min, extremes), tf.constant(np.iinfo(info).max, extremes)

    def step(chunk, valid=None):
        slots, top, bottom = elements(*chunk)
        if valid is not None:  # elements the chunk before counted
            slots = tf.where(valid, slots, _IGNORE)
            top, bottom = tf.where(valid, top, low), tf.where(valid, bottom, high)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(slots), slots, width + 1)[:width]
        return (counts, *tf_xla.variadic_reduce([top, bottom], [low, high], [0], _max_min(extremes)))

    if n <= _CHUNK:
        return step(arrays)
    chunks = -(-n // _CHUNK)

    def body(i, counts, top, bottom):
        start = tf.minimum(i * _CHUNK, n - _CHUNK)
        more, hi, lo = step([tf.slice(a, [start], [_CHUNK]) for a in arrays],
                            start + tf.range(_CHUNK) >= i * _CHUNK if n % _CHUNK else None)  # fmt: skip
        return i + 1, counts + more, tf.maximum(top, hi), tf.minimum(bottom, lo)

    start = [tf.constant(0), tf.zeros([width], tf.int32), low, high]
    _, counts, top, bottom = tf.while_loop(lambda i, *_: i < chunks, body, start)
    return counts, top, bottom


@functools.cache
def _max_min(dtype: tf.DType):
    """The reducer of ``_chunked``'s variadic reduction: (max, min) of pairs."""
    spec = tf.TensorSpec([], dtype)
    return tf.function(lambda a, b, c, d: (tf.maximum(a, c), tf.minimum(b, d))).get_concrete_function(
        spec, spec, spec, spec
    )


def _hist_elements(x):
    """Slots (``doctor/binning.py``), and the keys of the extremes (the bits of the largest finite and the
    smallest non-zero)."""
    a = tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32), _MASK)
    finite = a < _INF
    return core.value_slots(xp, a), tf.where(finite, a, 0), tf.where(finite & (a > 0), a, _MASK)


def _ratio_elements(u, w):
    """Slots of ``|u| / 2^b(w)`` (``doctor/binning.py``), and the ratios' keys for the extremes (module
    docstring)."""
    au = tf.bitwise.bitwise_and(tf.bitcast(u, tf.int32), _MASK)
    aw = tf.bitwise.bitwise_and(tf.bitcast(w, tf.int32), _MASK)
    slots, counted, e, nu = core.ratio_parts(xp, au, aw)
    key = tf.cast(e, tf.int64) * (1 << 52) + tf.cast(tf.bitwise.bitwise_and(nu, _MANT), tf.int64) * (1 << 29)
    return slots, tf.where(counted, key, tf.int64.min), tf.where(counted, key, tf.int64.max)


def _hist32(x):
    """The record of a flat float32 tensor: bins, zeros, nonfinite, the extremes as float64 bits."""
    counts, top, bottom = _chunked(_hist_elements, [x], N_BINS + 3, tf.int32)
    return tf.concat([tf.cast(counts[: N_BINS + 2], tf.int64), _widen(tf.stack([bottom, top]))], 0)


def _ratio32(u, w, after: bool = False):
    """The record of flat float32 ``u`` (or ``u - w`` when ``after``) relative to ``w``: bins, nonfinite,
    apart, zeros, the extremes' keys."""

    def elements(a, w):
        return _ratio_elements(a - w if after else a, w)

    counts, top, bottom = _chunked(elements, [u, w], N_BINS + 3, tf.int64)
    slots = tf.gather(counts, _RATIO_ORDER)
    return tf.concat([tf.cast(slots, tf.int64), tf.stack([bottom, top])], 0)


@functools.cache
def _compiled(kernel: str, n: int):
    """The float32 kernel ``kernel`` ("hist", "ratio", or "step": the ratio of ``after - before``) for
    ``n`` elements, compiled by XLA for that size (once per process, on its first call)."""
    fn = {"hist": _hist32, "ratio": _ratio32, "step": functools.partial(_ratio32, after=True)}[kernel]
    specs = [tf.TensorSpec([n], tf.float32)] * (1 if kernel == "hist" else 2)
    return tf.function(fn, jit_compile=True, autograph=False).get_concrete_function(*specs)


# -- the general kernel (int64, many tensors at once) ------------------------------------------------
def _i64(v: int):
    return _c(v, tf.int64)


_c, _shr, _and = xp_int.graph_const, xp_int.shift_right, xp_int.bit_and


def _segments(groups: list[list]):
    """For ``groups`` of flat floating tensors (the updates, the weights), aligned: each group's float64
    magnitude bits (int64) in one concatenation, each element's segment (its position in the group) and
    their count. Positions whose tensors are all narrower than float64 are widened together."""
    n = len(groups[0])
    narrow = [i for i in range(n) if all(g[i].dtype != tf.float64 for g in groups)]
    order = narrow + [i for i in range(n) if i not in set(narrow)]
    bits = []
    for g in groups:
        parts = [_bits64(tf.concat([tf.cast(g[i], tf.float32) for i in narrow], 0))] if narrow else []
        bits.append(tf.concat(parts + [_bits64(g[i]) for i in order[len(narrow) :]], 0))
    seg = tf.repeat(tf.constant(order, tf.int32), tf.stack([tf.size(groups[0][i]) for i in order]))
    return bits, seg, n


def _widen(a):
    """float32 magnitude bits (int32) -> the same values' float64 bits (int64), exactly; subnormals
    through an integer-to-float conversion (exact: ``a < 2^23``)."""
    a = tf.cast(a, tf.int64)
    e = _shr(a, 23)
    e = tf.where(e == 255, _i64(2047), e + (1023 - 127))
    wide = tf.bitwise.bitwise_or(e * (1 << 52), _and(a, _MANT) * (1 << 29))
    tiny = tf.bitcast(tf.cast(a, tf.float64), tf.int64) - (149 << 52)  # a * 2^-149, a < 2^23
    return tf.where(a >= _NORMAL, wide, tf.where(a == 0, _i64(0), tiny))


def _bits64(t):
    """A floating tensor's magnitudes as float64 bits (int64)."""
    if t.dtype == tf.float64:
        return _and(tf.bitcast(t, tf.int64), _MASK64)
    a = _and(tf.bitcast(tf.cast(t, tf.float32), tf.int32), _MASK)
    return _WIDEN(a) if tf.executing_eagerly() else _widen(a)


def _bincount(keys, size: int, dtype=tf.int32):
    """Counts of ``keys`` (in ``[0, size)``): ``DenseBincount`` of a known size, without the pass
    ``tf.math.bincount`` makes for the largest key."""
    return tf.raw_ops.DenseBincount(input=keys, size=_c(size, keys.dtype), weights=_c([], dtype))


def _by_segment(code, width: int, seg, n: int):
    """Counts of ``code`` (in ``[0, width)``) per segment: ``[n, width]`` int64."""
    if seg is None:
        return tf.reshape(_bincount(code, width, tf.int64), [1, width])
    return tf.reshape(_bincount(code + tf.cast(seg, code.dtype) * width, n * width, tf.int64), [n, width])


def _segment_min(x, seg, n: int):
    return tf.reshape(tf.reduce_min(x), [1]) if seg is None else tf.math.unsorted_segment_min(x, seg, n)


def _segment_max(x, seg, n: int):
    return tf.reshape(tf.reduce_max(x), [1]) if seg is None else tf.math.unsorted_segment_max(x, seg, n)


def _hist64(a, seg=None, n: int = 1):
    """The general histogram of float64 magnitude bits ``a`` (int64), by segment: ``[n, N_BINS + 4]`` rows
    of bin counts, zeros, nonfinite, the smallest non-zero and the largest finite bits."""
    code = core.value_slots(xp, a, core.F64)
    lo = _segment_min(tf.where(a > 0, a, _i64(_MASK64)), seg, n)
    hi = _segment_max(tf.where(a < _INF64, a, _i64(-1)), seg, n)
    return tf.concat([_by_segment(code, N_BINS + 2, seg, n), lo[:, None], hi[:, None]], 1)


def _ratio64(au, aw, seg=None, n: int = 1):
    """The ratio spec (``doctor/binning.py``) on float64 magnitude bits, by segment: ``[n, N_BINS + 5]`` rows
    of counts (bins, then nonfinite, apart, zeros) and min and max of ``clip(E) * 2^52 + mantissa(u)``
    over the regular elements."""
    code, regular, e, nu = core.ratio_parts(xp, au, aw, core.F64)
    key = tf.clip_by_value(e, -_E_CLIP, _E_CLIP) * (1 << 52) + _and(nu, _MANT64)
    lo = _segment_min(tf.where(regular, key, _i64(tf.int64.max)), seg, n)
    hi = _segment_max(tf.where(regular, key, _i64(tf.int64.min)), seg, n)
    counts = tf.gather(_by_segment(code, N_BINS + 3, seg, n), _c(_RATIO_ORDER, tf.int32), axis=1)
    return tf.concat([counts, lo[:, None], hi[:, None]], 1)


_HIST64 = tf.function(_hist64, input_signature=[tf.TensorSpec([None], tf.int64)])
_RATIO64 = tf.function(_ratio64, input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
_WIDEN = tf.function(_widen, input_signature=[tf.TensorSpec([None], tf.int32)])
