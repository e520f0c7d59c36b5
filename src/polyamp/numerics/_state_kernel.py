"""Compiled kernels of the low-precision training state (numba), one pass each over CPU arrays.

``stochastic_bf16``: float32 bits rounded stochastically to bfloat16 bits, the same bits as
``quantize(y, "bf16", "stochastic", seed)``: with ``low`` the 16 bits bfloat16 drops and ``z`` the
element's stream word (``stream.uniform53``'s, so ``u = (z >> 11) / 2^53``), the core's test
``u < low / 2^16`` is ``z >> 48 < low``, and the magnitude then goes one bfloat16 step up. A step past
bfloat16's max takes nearest's value, as the core; inf stays, NaN stays NaN (its sign kept).

``encode_int8`` / ``decode_int8``: ``state_codes``' 8-bit form, block by block (the look-up of
``state_codes._nearest_lookup``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ._kernel import _GOLDEN, _M1, _M2, _S27, _S30, _S31

_S48 = np.uint64(48)


@nb.njit(parallel=True, cache=True, nogil=True)
def stochastic_bf16(bits, out, key):
    """``bits``: float32 patterns (uint32), ``out``: bfloat16 patterns (uint16), ``key``: ``mix(seed)``."""
    for i in nb.prange(bits.size):
        b = bits[i]
        mag = b & np.uint32(0x7FFFFFFF)
        if mag > np.uint32(0x7F800000):  # NaN: quiet, sign kept
            out[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
            continue
        z = key + np.uint64(i + 1) * _GOLDEN
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        z = z ^ (z >> _S31)
        up = np.uint32(1) if np.uint64(z >> _S48) < np.uint64(b & np.uint32(0xFFFF)) else np.uint32(0)
        t = (b >> np.uint32(16)) + up
        if mag != np.uint32(0x7F800000) and (t & np.uint32(0x7FFF)) == np.uint32(0x7F80):
            t = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)  # nearest
        out[i] = np.uint16(t)


@nb.njit(parallel=True, cache=True, nogil=True)
def encode_int8(m, codes, scale, base, mid, block):
    """``m`` float32 (flat), into ``codes`` (uint8, same size) and ``scale`` (float32, one per block)."""
    n = m.size
    for k in nb.prange(scale.size):
        lo, hi = k * block, min(n, (k + 1) * block)
        amax = np.float32(0.0)
        for i in range(lo, hi):
            a = abs(m[i])
            amax = a if a > amax or a != a else amax
        scale[k] = amax
        d = amax if amax > 0 else np.float32(1.0)
        for i in range(lo, hi):
            v = np.float32(m[i] / d)
            key = v.view(np.uint32) >> np.uint32(16)
            codes[i] = np.uint8(base[key] + (1 if v > mid[key] else 0))


@nb.njit(parallel=True, cache=True, nogil=True)
def decode_int8(codes, scale, table, out, block):
    n = codes.size
    for k in nb.prange(scale.size):
        s = scale[k]
        for i in range(k * block, min(n, (k + 1) * block)):
            out[i] = table[codes[i]] * s


@nb.njit(inline="always")
def _nearest(b):
    """float32 bits -> bfloat16 bits, to nearest even (NaN: quiet, sign kept)."""
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@nb.njit(inline="always")
def _wide(h):
    """bfloat16 bits -> float32 bits."""
    return np.uint32(np.uint32(h) << np.uint32(16))


@nb.njit(parallel=True, cache=True, nogil=True)
def widen_bf16(src, dst):
    """bfloat16 patterns (uint16) -> float32 patterns (uint32): exact."""
    for i in nb.prange(src.size):
        dst[i] = _wide(src[i])


@nb.njit(parallel=True, cache=True, nogil=True)
def widen_add_bf16(w, c, dst):
    """float32 ``w + c`` of two bfloat16 patterns, written as float32 (``dst``)."""
    for i in nb.prange(w.size):
        dst[i] = _wide(w[i]).view(np.float32) + _wide(c[i]).view(np.float32)


@nb.njit(parallel=True, cache=True, nogil=True)
def kahan_bf16(y, w, c):
    """Kahan's write-back: ``w = nearest(y)``, ``c = nearest(y - w)`` (``y - w`` is exact in float32)."""
    for i in nb.prange(y.size):
        b = np.float32(y[i]).view(np.uint32)
        wb = _nearest(b)
        w[i] = wb
        c[i] = _nearest(np.float32(y[i] - _wide(wb).view(np.float32)).view(np.uint32))
