"""The compiled quantize kernel: the algorithm of ``rounding.py``, one element at a time.

Written so LLVM can vectorise it: float64 arithmetic on exact values, the spacing ``q`` built from
exponent bits (a bitcast, no libm call), selects instead of branches, and the stochastic bits from
a counter-based hash, so each thread's share of the array needs no shared generator state.
Importing this module imports numba; ``rounding.py`` does so only on first use.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .stream import GOLDEN, M1, M2

_GOLDEN, _M1, _M2 = (np.uint64(c) for c in (GOLDEN, M1, M2))  # numba takes module globals as constants
_S30, _S27, _S31, _S11, _S52 = (np.uint64(s) for s in (30, 27, 31, 11, 52))
_ABS = np.uint64(0x7FFFFFFFFFFFFFFF)


@intrinsic
def _bits(typingctx, x):
    """float64 -> its uint64 bit pattern."""
    return types.uint64(types.float64), lambda ctx, b, sig, args: b.bitcast(args[0], ir.IntType(64))


@intrinsic
def _float(typingctx, u):
    """uint64 bit pattern -> float64."""
    return types.float64(types.uint64), lambda ctx, b, sig, args: b.bitcast(args[0], ir.DoubleType())


@nb.njit(inline="always")
def _uniform(key, i):
    z = key + np.uint64(i + 1) * _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z = z ^ (z >> _S31)
    return np.float64(z >> _S11) * 2.0**-53


@nb.njit(inline="always")
def _element(v, i, mbits, emin_b, emaxp1_b, maxval, overflow, mode, pos_zero, key):
    a = abs(v)
    field = _bits(a) >> _S52
    e = min(max(field, emin_b), emaxp1_b)  # biased float64 exponent of a, clamped to the format
    q = _float((e - mbits) << _S52)
    t = a * _float((np.uint64(2046) + mbits - e) << _S52)
    n = np.rint(t)
    if mode == 0:
        r = n
    elif mode == 2:
        r = np.floor(t)
    else:
        f = np.floor(t)
        r = f + (1.0 if _uniform(key, i) < t - f else 0.0)
    r = r * q
    if r > maxval:
        r = maxval if (mode == 2 or n * q <= maxval) else overflow
    if a == np.inf:
        r = overflow
    r = np.copysign(r, v)
    if pos_zero and r == 0.0:
        r = 0.0
    return r


@nb.njit(parallel=True, cache=True, nogil=True)
def quantize_kernel(x, out, mbits, emin, emax, maxval, overflow, mode, pos_zero, key):
    """out[i] = round(x[i]) onto the format; x and out are 1-D float32 or float64 arrays."""
    m = np.uint64(mbits)
    emin_b = np.uint64(emin + 1023)
    emaxp1_b = np.uint64(emax + 1 + 1023)
    # One loop per mode so that each compiles without the others' branches.
    if mode == 0:
        for i in nb.prange(x.size):
            out[i] = _element(np.float64(x[i]), i, m, emin_b, emaxp1_b, maxval, overflow, 0,
                              pos_zero, key)  # fmt: skip
    elif mode == 2:
        for i in nb.prange(x.size):
            out[i] = _element(np.float64(x[i]), i, m, emin_b, emaxp1_b, maxval, overflow, 2,
                              pos_zero, key)  # fmt: skip
    else:
        for i in nb.prange(x.size):
            out[i] = _element(np.float64(x[i]), i, m, emin_b, emaxp1_b, maxval, overflow, 1,
                              pos_zero, key)  # fmt: skip


@nb.njit(parallel=True, cache=True, nogil=True)
def uniform_grid(key, first, row_step, col_step, out):
    """out[r, c] = the stream's uniform of flat index first + r * row_step + c * col_step (``_uniform``:
    splitmix64 of key + (index + 1) * golden, 53 bits); ``out`` a 2-D float64 array, filled in place."""
    rows, cols = out.shape
    for r in nb.prange(rows):
        base = first + r * row_step
        for c in range(cols):
            out[r, c] = _uniform(key, base + c * col_step)


@nb.njit(parallel=True, cache=True, nogil=True)
def stochastic_tiles(p, bf16, den, scale, tile_r, tile_c, key, first, row_step, col_step,
                     mbits, emin_b, emaxp1_b, maxval, out):  # fmt: skip
    """NVFP4-style block elements with stochastic rounding, one pass (torch's ``_nvfp4_plane``): for each
    ``p[r, c]`` (float32, or bfloat16 bit patterns as int16 when ``bf16``) in tile ``(r // tile_r,
    c // tile_c)``, ``t = p / den[tile]`` in float64, rounded onto the element grid (``mbits``, biased
    exponent range ``[emin_b, emaxp1_b]``) up with probability of its remainder, the stream's uniform of
    flat index ``first + r * row_step + c * col_step`` against it, clamped to ``maxval``, signed as ``t``,
    times ``scale[tile]`` (NaN there: the result is NaN) and rounded to float32 into ``out``."""
    rows, cols = out.shape
    for r in nb.prange(rows):
        base = first + r * row_step
        tr = r // tile_r
        if tile_c == 1:  # blocks down the columns: each element its own column's block
            for c in range(cols):
                v = np.float64(_float32_of_bf16(p[r, c])) if bf16 else np.float64(p[r, c])
                u = _uniform(key, base + c * col_step)
                out[r, c] = _stochastic_element(
                    v, den[tr, c], scale[tr, c], u, mbits, emin_b, emaxp1_b, maxval
                )
            continue
        for tc in range(cols // tile_c):
            d, s = den[tr, tc], scale[tr, tc]
            for c in range(tc * tile_c, (tc + 1) * tile_c):
                v = np.float64(_float32_of_bf16(p[r, c])) if bf16 else np.float64(p[r, c])
                u = _uniform(key, base + c * col_step)
                out[r, c] = _stochastic_element(v, d, s, u, mbits, emin_b, emaxp1_b, maxval)


@nb.njit(inline="always")
def _stochastic_element(v, d, s, u, mbits, emin_b, emaxp1_b, maxval):
    """``stochastic_tiles``' value of one element ``v`` of a block with divisor ``d`` and scale ``s``."""
    t = v / d
    a = abs(t)
    e = min(max(_bits(a) >> _S52, np.uint64(emin_b)), np.uint64(emaxp1_b))
    w = a * _float((np.uint64(2046 + mbits) - e) << _S52)  # a / spacing, exact
    f = np.floor(w)
    q = min((f + (1.0 if u < w - f else 0.0)) * _float((e - np.uint64(mbits)) << _S52), maxval)
    return np.float32(np.copysign(q, t) * s) if s == s else np.float32(np.nan)


@intrinsic
def _float32(typingctx, u):
    """uint32 bit pattern -> float32."""
    return types.float32(types.uint32), lambda ctx, b, sig, args: b.bitcast(args[0], ir.FloatType())


@nb.njit(inline="always")
def _float32_of_bf16(h):
    """A bfloat16 given as its int16 bit pattern -> float32 (exact)."""
    return _float32(np.uint32(np.uint16(h)) << np.uint32(16))
