"""The compiled binning kernels (numba): a float32 histogram, and a weight's histogram with its update
ratio's, in one pass over host memory with no temporary arrays.

For float32 magnitude bits ``a``: a normal number is ``2^b * (1 + f / 2^23)`` with ``b = (a >> 23) - 127``
and ``f = a & 0x7fffff``; a subnormal, ``a * 2^-149``, is normalised by its leading bit. Its spec index
(``histogram.py``) is ``SUB * (b - B_MIN) + (f >> (23 - log2 SUB)) + 1``. The update ratio ``|u| / 2^b(w)``
of ``u = p - w`` (float32 subtraction, as the optimizer's step is read back) has the index of ``|u|`` less
``SUB * b(w)``, clamped to the spec's range, and the exact value ``2^(b(u) - b(w)) * (1 + f(u) / 2^23)``,
kept as the ordered key ``(b(u) - b(w) + 512) << 23 | f(u)``. Zeros, inf/NaN and (for ratios) zero weights
are counted apart, as ``LogHistogram`` and ``update_ratio_histogram`` do.

Each kernel returns one int64 vector per histogram (``vector.py``). Threads take contiguous shares and
keep their own counts.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .histogram import B_MIN, N_BINS, SUB
from .vector import APART, HIGH, KEY_BIAS, LENGTH, LOW, NONE, NONFINITE, ZEROS

_FRAC = 23 - (SUB.bit_length() - 1)  # f >> _FRAC is the sub-bin
_INF, _MASK, _NORMAL = 0x7F800000, 0x7FFFFFFF, 0x00800000
_OFFSET = SUB * (-127 - B_MIN) + 1  # index - (a >> _FRAC) of a normal float32
_RATIO_OFFSET = -SUB * B_MIN + 1  # index - ((a(u) >> _FRAC) - (e(w) >> _FRAC)) of a ratio of normals


@intrinsic
def _bits(typingctx, x):
    """float32 -> its int32 bit pattern."""
    return types.int32(types.float32), lambda ctx, b, sig, args: b.bitcast(args[0], ir.IntType(32))


@nb.njit(inline="always")
def _split(a):
    """(b, f) of the non-zero finite float32 magnitude bits ``a``: value ``2^b * (1 + f / 2^23)``."""
    e = a >> 23
    if e > 0:
        return e - 127, a & 0x7FFFFF
    p = 22
    while (a >> p) == 0:
        p -= 1
    return p - 149, (a << (23 - p)) & 0x7FFFFF


_BIG = 1 << 62  # a loop's smallest key before any (NONE once stored)


@nb.njit(inline="always")
def _index(b, f):
    return SUB * (b - B_MIN) + (f >> _FRAC) + 1


@nb.njit(inline="always")
def _store(out, high, low):
    out[HIGH] = high
    out[LOW] = NONE if low == _BIG else low


def _fresh(threads: int) -> np.ndarray:
    out = np.zeros((threads, LENGTH), np.int64)
    out[:, HIGH] = out[:, LOW] = NONE
    return out


@nb.njit(inline="always")
def _reduce(parts):
    """One thread's vectors -> one: counts summed, extremes reduced (NONE ignored)."""
    out = parts[0].copy()
    for t in range(1, parts.shape[0]):
        for i in range(HIGH):
            out[i] += parts[t, i]
        if parts[t, HIGH] != NONE and parts[t, HIGH] > out[HIGH]:
            out[HIGH] = parts[t, HIGH]
        if parts[t, LOW] != NONE and (out[LOW] == NONE or parts[t, LOW] < out[LOW]):
            out[LOW] = parts[t, LOW]
    return out


@nb.njit(parallel=True, cache=True, nogil=True)
def _values_kernel(x, parts):
    n, threads = x.size, parts.shape[0]
    share = (n + threads - 1) // threads
    for t in nb.prange(threads):
        out = parts[t]
        high, low = np.int64(NONE), np.int64(_BIG)
        for i in range(t * share, min(n, (t + 1) * share)):
            a = np.int64(_bits(x[i]) & _MASK)
            if _NORMAL <= a < _INF:  # the index without splitting: SUB * biased exponent + sub-bin
                out[(a >> _FRAC) + _OFFSET] += 1
            elif a == 0:
                out[ZEROS] += 1
                continue
            elif a >= _INF:
                out[NONFINITE] += 1
                continue
            else:
                b, f = _split(a)
                out[_index(b, f)] += 1
            high, low = max(high, a), min(low, a)
        _store(out, high, low)
    return _reduce(parts)


@nb.njit(parallel=True, cache=True, nogil=True)
def _ratio_kernel(w, p, weights, ratios):
    n, threads = w.size, weights.shape[0]
    share = (n + threads - 1) // threads
    for t in nb.prange(threads):
        hw, hr = weights[t], ratios[t]
        w_high, w_low, r_high, r_low = np.int64(NONE), np.int64(_BIG), np.int64(NONE), np.int64(_BIG)
        for i in range(t * share, min(n, (t + 1) * share)):
            aw = np.int64(_bits(w[i]) & _MASK)
            au = np.int64(_bits(np.float32(p[i] - w[i])) & _MASK)
            if _NORMAL <= aw < _INF and _NORMAL <= au < _INF:  # both normal: no splitting
                hw[(aw >> _FRAC) + _OFFSET] += 1
                ew = aw & _INF
                hr[min(max((au >> _FRAC) - (ew >> _FRAC) + _RATIO_OFFSET, 0), N_BINS - 1)] += 1
                key = au - ew + KEY_BIAS
            elif aw == 0:
                hw[ZEROS] += 1
                hr[NONFINITE if au >= _INF else APART] += 1
                continue
            elif aw >= _INF:
                hw[NONFINITE] += 1
                hr[NONFINITE] += 1
                continue
            else:
                bw, fw = _split(aw)
                hw[_index(bw, fw)] += 1
                if au >= _INF or au == 0:
                    hr[NONFINITE if au else ZEROS] += 1
                    w_high, w_low = max(w_high, aw), min(w_low, aw)
                    continue
                bu, fu = _split(au)
                s = bu - bw
                hr[min(max(_index(s, fu), 0), N_BINS - 1)] += 1
                key = (s << 23 | fu) + KEY_BIAS
            w_high, w_low = max(w_high, aw), min(w_low, aw)
            r_high, r_low = max(r_high, key), min(r_low, key)
        _store(hw, w_high, w_low)
        _store(hr, r_high, r_low)
    return _reduce(weights), _reduce(ratios)


def values(x: np.ndarray) -> np.ndarray:
    """The vector (module docstring) of the flat float32 array ``x``."""
    return _values_kernel(x, _fresh(nb.get_num_threads()))


def weight_and_ratio(w: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The vectors of the flat float32 weight ``w`` before a step and of the update ratio of ``p - w``."""
    threads = nb.get_num_threads()
    return _ratio_kernel(w, p, _fresh(threads), _fresh(threads))
