"""The doctor's binning in numpy on host memory, a chunk at a time: a front end's fast path for arrays it
can view as numpy (MXNet's, through DLPack). ``buffer(slot, dtype, size)`` gives a work buffer of at
most ``CHUNK`` elements per slot, kept by the caller; the chunks' buffers stay in the core's cache.
The results equal ``LogHistogram.of`` and ``update_ratio_histogram`` exactly.
"""

from __future__ import annotations

import numpy as np

from .binning import F32 as _F32
from .binning import float_of, normal_counts
from .histogram import N_BINS, SUB, LogHistogram, bin_index

_MASK, _INF, _NORMAL, _ONE = _F32.mask, _F32.inf, _F32.normal, 0x3F800000  # float32 bit patterns
CHUNK = 1 << 16  # elements per pass


def magnitudes(chunk: np.ndarray, name: str, buffer) -> np.ndarray:
    """The int32 bits of ``|chunk|`` in float32 (fp16 and bf16 widened exactly), in a work buffer."""
    a = buffer("a", np.int32, chunk.size)
    if name == "float32":
        np.bitwise_and(chunk, _MASK, out=a)
        return a
    if name == "float16":
        np.copyto(a.view(np.float32), chunk)
    else:  # bfloat16: a float32's upper half
        bits = a.view(np.uint32)
        np.copyto(bits, chunk)
        np.left_shift(bits, 16, out=bits)
    np.bitwise_and(a, _MASK, out=a)
    return a


def histogram(view: np.ndarray, name: str, buffer, copy: np.ndarray | None = None) -> LogHistogram:
    """The histogram of a flat host array (``view``: float32 as int32 bits, float16, or bfloat16 as uint16
    bits; ``name`` its dtype's name), in chunks of ``CHUNK``: for the
    float32 magnitude bits ``a`` of each, ``a >> 19`` counted by ``bincount`` (the module docstring's
    keys), ``a.min()`` and ``a.max()``. A chunk with inf/NaN takes its finite maximum from
    ``(a - 0x7f800000) & 0x7fffffff``, which puts every finite ``a`` above them, 0x800000 higher; one
    with zeros counts them and takes its non-zero minimum from ``(a - 1) & 0x7fffffff`` (zero wraps to
    the largest); subnormals found there (rare) are binned by the core's ``bin_index``. With ``copy``
    (of ``view``'s shape and dtype), each chunk is first copied there and binned from there."""
    keys = np.zeros(_F32.keys, np.int64)
    subnormal = np.zeros(N_BINS, np.int64)
    zeros, lo, hi = 0, _INF, -1  # lo: the least non-zero a (_INF: none); hi: the largest finite a (-1: none)
    for start in range(0, view.size, CHUNK):
        chunk = view[start : start + CHUNK]
        if copy is not None:
            chunk = copy[start : start + CHUNK]
            np.copyto(chunk, view[start : start + CHUNK])
        a = magnitudes(chunk, name, buffer)
        k = buffer("k", np.intp, a.size)
        np.right_shift(a, _F32.shift, out=k)
        keys += np.bincount(k, minlength=_F32.keys)
        least, most = int(a.min()), int(a.max())
        if most >= _INF:
            np.subtract(a, _INF, out=a)
            np.bitwise_and(a, _MASK, out=a)
            most = int(a.max()) - _NORMAL  # negative: no finite element
            if least < _NORMAL:
                a = magnitudes(chunk, name, buffer)
        if least < _NORMAL:
            nonzero = np.count_nonzero(a)
            zeros += a.size - nonzero
            least = _INF
            if nonzero:
                np.subtract(a, 1, out=a)
                np.bitwise_and(a, _MASK, out=a)
                least = int(a.min()) + 1
                if least < _NORMAL:
                    tiny = (a[a < _NORMAL - 1] + 1).view(np.float32)
                    subnormal += np.bincount(bin_index(tiny), minlength=N_BINS)
        lo, hi = min(lo, least), max(hi, most)
    top = _F32.inf >> _F32.shift
    return LogHistogram.from_counts(
        normal_counts(keys) + subnormal,
        zeros=zeros,
        nonfinite=int(keys[top:].sum()),
        amax=float_of(hi) if hi > 0 else 0.0,
        amin_nonzero=float_of(lo) if lo < _INF else None,
    )


def update_fits(before_hist: LogHistogram) -> bool:
    """Whether ``update`` applies to a weight of histogram ``before_hist``: finite, and zero or not below
    2^-102 (a non-zero update is then at least 2^(b(w) - 24), its ratio normal unless it reaches 2^128)."""
    return not before_hist.nonfinite and (before_hist.amin_nonzero or 1.0) >= 2.0**-102


def update(after: np.ndarray, before: np.ndarray, before_hist: LogHistogram, buffer) -> LogHistogram | None:
    """The ratio histogram of the step ``after - before`` (flat float32 host arrays; ``before_hist``:
    ``before``'s histogram, ``update_fits``), or None when a ratio reaches 2^128. In chunks: ``u = after -
    before``, ``a = bits(u) & 0x7fffffff``, the ratio bits ``a - (bits(w) & 0x7f800000) + 0x3f800000``,
    set to 0 where ``u`` or ``w`` is zero (key 0; every other ratio is normal), counted as in
    ``histogram``."""
    floor = _bits_of(before_hist.amin_nonzero) >> _F32.mant if before_hist.amin_nonzero else 0
    keys = np.zeros(_F32.keys, np.int64)
    lo, hi = _INF, -1
    for start in range(0, after.size, CHUNK):
        w = before[start : start + CHUNK].view(np.int32)
        u = buffer("u", np.float32, w.size)
        np.subtract(after[start : start + CHUNK], w.view(np.float32), out=u)
        a = u.view(np.int32)
        np.bitwise_and(a, _MASK, out=a)
        most = int(a.max())
        if most >= _INF or (floor and (most >> _F32.mant) - floor > 127):  # a ratio of 2^128 or more
            return None
        r = buffer("r", np.int32, w.size)
        np.bitwise_and(w, _INF, out=r)  # 2^b(w); 0 for w == 0 (no w is subnormal here)
        masks = []
        if before_hist.zeros:
            masks.append(np.equal(r, 0, out=buffer("w0", np.bool_, w.size)))
        np.subtract(a, r, out=r)
        np.add(r, _ONE, out=r)
        if int(a.min()) == 0:
            masks.append(np.equal(a, 0, out=buffer("u0", np.bool_, w.size)))
        for mask in masks:
            np.copyto(r, 0, where=mask)
        k = buffer("k", np.intp, w.size)
        np.right_shift(r, _F32.shift, out=k)
        keys += np.bincount(k, minlength=_F32.keys)
        hi = max(hi, int(r.max()))
        if masks:  # the zeros set wrap to the largest
            np.subtract(r, 1, out=r)
            np.bitwise_and(r, _MASK, out=r)
            lo = min(lo, int(r.min()) + 1)
        else:
            lo = min(lo, int(r.min()))
    special = int(keys[:SUB].sum())
    regular = before.size - special
    return LogHistogram.from_counts(
        normal_counts(keys),
        zeros=special - before_hist.zeros,
        nonfinite=0,
        amax=float_of(hi) if regular else 0.0,
        amin_nonzero=float_of(lo) if regular else None,
        apart=before_hist.zeros,
    )


def _bits_of(x: float) -> int:
    return int(np.array(x, np.float32).view(np.int32))
