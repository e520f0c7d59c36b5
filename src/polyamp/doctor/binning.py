"""The binning spec of ``histogram.py`` in integer arithmetic on bit patterns, once for every front end.

Each function takes the front end's ops module (``polyamp.<framework>.xp``, section "binning") and
its arrays; XLA's CPU kernels and TensorFlow's treat subnormal floats as zero, so no float arithmetic
or comparison is made. For a float ``Width`` (``mant`` mantissa bits, exponent bias ``bias``), the
magnitude bits ``a = bits & mask`` of a finite non-zero value have the pseudo bits::

    p = a                                        a normal
    p = bits(float(a)) - (tiny << mant)          a subnormal, a * 2^-tiny (float(a) exact: a < 2^mant)

with the value ``2^((p >> mant) - bias) * (1 + (p & (2^mant - 1)) / 2^mant)`` (``p`` may be negative;
shifts are arithmetic). The spec's index is then ``(p >> (mant - log2 SUB)) + offset`` (clipped to
``[0, N_BINS)``: float64 reaches past the spec's binades), and that of the update ratio ``|u| / 2^b(w)``
``((p(u) >> (mant - log2 SUB)) - SUB * (p(w) >> mant)) + 1 - SUB * B_MIN``, clipped. Zeros, inf/NaN and
(for ratios) zero weights go to the slots ``ZEROS``, ``NONFINITE``, ``APART`` of ``vector.py``, in the
order of ``update_ratio_histogram``. The extremes' keys and the counting (bincount, scatter-add) are the
front end's own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .histogram import B_MIN, N_BINS, SUB
from .vector import APART, NONFINITE, ZEROS

_LOG_SUB = SUB.bit_length() - 1  # SUB is a power of two


@dataclass(frozen=True)
class Width:
    """A binary float's bit layout: mantissa bits and exponent bias."""

    mant: int
    bias: int

    @property
    def mask(self) -> int:  # the magnitude bits
        return (1 << (self.bits - 1)) - 1

    @property
    def bits(self) -> int:
        return 32 if self.mant == 23 else 64

    @property
    def inf(self) -> int:  # the bits of inf; the exponent field's mask
        return (2 * self.bias + 1) << self.mant

    @property
    def normal(self) -> int:  # the bits of the smallest normal
        return 1 << self.mant

    @property
    def tiny(self) -> int:  # the smallest subnormal is 2^-tiny
        return self.bias - 1 + self.mant

    @property
    def shift(self) -> int:  # a normal's bits >> shift = SUB * biased exponent + sub-bin
        return self.mant - _LOG_SUB

    @property
    def offset(self) -> int:  # spec index - (p >> shift)
        return 1 - SUB * (self.bias + B_MIN)

    @property
    def keys(self) -> int:  # the number of keys a >> shift of magnitude bits
        return (self.mask >> self.shift) + 1


F32, F64 = Width(23, 127), Width(52, 1023)
RATIO_OFFSET = 1 - SUB * B_MIN  # ratio index - ((p(u) >> shift) - SUB * (p(w) >> mant))


def pseudo(ops, a, w: Width = F32):
    """The pseudo bits (module docstring) of the finite non-zero magnitude bits ``a``; zeros and inf/NaN
    come out as garbage, for the caller to mask."""
    return ops.select(a < w.normal, ops.float_bits(ops.int_float(a)) - (w.tiny << w.mant), a)


def index(ops, p, w: Width = F32):
    """The spec's bin of the pseudo bits ``p``."""
    idx = ops.shift_right(p, w.shift) + w.offset
    return idx if w is F32 else ops.clamp_int(idx, 0, N_BINS - 1)


def value_slots(ops, a, w: Width = F32):
    """Each element's slot for the magnitude bits ``a``: its bin, ``ZEROS`` or ``NONFINITE``."""
    return ops.select(a == 0, ZEROS, ops.select(a < w.inf, index(ops, pseudo(ops, a, w), w), NONFINITE))


def ratio_parts(ops, au, aw, w: Width = F32):
    """``(slots, counted, s, pu)`` of the update ratio of the magnitude bits ``au``, ``aw``: each element's
    slot (its bin, or ``NONFINITE`` for a non-finite u or w, then ``APART`` for a zero w, then ``ZEROS``
    for a zero u), whether it is binned, its ratio's binade ``s = b(u) - b(w)`` and u's pseudo bits."""
    pu, pw = pseudo(ops, au, w), pseudo(ops, aw, w)
    s = ops.shift_right(pu, w.mant) - ops.shift_right(pw, w.mant)
    k = ops.bit_and(ops.shift_right(pu, w.shift), SUB - 1)
    idx = ops.clamp_int(s * SUB + k + RATIO_OFFSET, 0, N_BINS - 1)
    bad = (au >= w.inf) | (aw >= w.inf)
    apart, zero = aw == 0, au == 0
    slots = ops.select(bad, NONFINITE, ops.select(apart, APART, ops.select(zero, ZEROS, idx)))
    return slots, ~(bad | apart | zero), s, pu


def normal_counts(keys: np.ndarray, w: Width = F32) -> np.ndarray:
    """The spec's counts of the normal floats among the counts of the keys ``a >> w.shift`` (host)."""
    top = w.inf >> w.shift
    first, last = SUB + w.offset, top - 1 + w.offset
    if first >= 0 and last < N_BINS:  # float32: each normal key is a bin of its own
        counts = np.zeros(N_BINS, np.int64)
        counts[first : last + 1] = keys[SUB:top]
        return counts
    idx = np.clip(np.arange(SUB, top) + w.offset, 0, N_BINS - 1)
    return np.bincount(idx, weights=keys[SUB:top], minlength=N_BINS).astype(np.int64)  # exact below 2^53


def float_of(bits: int, w: Width = F32) -> float:
    """The float whose bits are ``bits``."""
    ints, floats = ("<i", "<f") if w is F32 else ("<q", "<d")
    return struct.unpack(floats, struct.pack(ints, bits))[0]
