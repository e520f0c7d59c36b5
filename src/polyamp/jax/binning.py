"""The doctor's JAX binning: ``histogram(x)``, ``ratio_histogram(update, weight)`` and the chunked
per-(layer, kind) statistics ``collect``'s program computes (``stats``).

Binning: a float32 (narrower floats widened exactly; float64 likewise on int64) is read as int32 bits,
``a = bits & 0x7fffffff``; a normal float's index is ``(a >> 19) + 353``, a subnormal's comes from the
float ``a`` (exact, ``a < 2^23``) less 149 binades, and zeros, inf/NaN (and, for ratios, zero weights) go to
extra slots of one scatter-add (``bincount``) per (layer, kind). Integer arithmetic throughout: XLA on CPU
treats subnormal floats as zero in float arithmetic and comparisons. The extremes are the max and min of
the magnitude bits (one variadic integer reduction). An update ratio ``|u| / 2^b(w)`` takes ``b(u) - b(w)``
and ``k(u)`` from the bits; its extremes are kept as (binade, mantissa) keys, as the ratio can leave
float32's range (``_ratio_elements``). Arrays over ``_CHUNK`` elements are binned in a loop over chunks
(``_stats``). The results equal ``LogHistogram.of`` / ``update_ratio_histogram`` exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..doctor import binning as core
from ..doctor.histogram import N_BINS, LogHistogram
from ..doctor.vector import APART, NONFINITE, ZEROS
from ..errors import PolyampError
from . import xp

_SLOTS = N_BINS + 3
IGNORE = _SLOTS  # where the elements that a chunk repeats are counted, and dropped
_CHUNK = 1 << 18
_SCATTER = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                       scatter_dims_to_operand_dims=(0,))  # fmt: skip


@dataclass(frozen=True)
class _Layout:
    """A float dtype's bits: the same-width int, the mantissa bits and the exponent bias."""

    float: np.dtype
    int: np.dtype
    mant: int
    bias: int

    @property
    def inf(self) -> int:  # also the exponent field's mask
        return (2 * self.bias + 1) << self.mant

    @property
    def normal(self) -> int:
        return 1 << self.mant

    @property
    def tiny(self) -> int:  # the smallest subnormal is 2^-tiny
        return self.bias - 1 + self.mant

    @property
    def width(self) -> core.Width:
        return core.F32 if self.mant == 23 else core.F64

    @property
    def window(self) -> tuple[int, int]:
        """(top, offset): a ratio key ``e << mant | mantissa`` with e in [-top - 1, top] lies strictly
        between the int's min and max; a ratio's binade is within +-(top + offset) (``_ratio_elements``)."""
        top = (1 << (8 * self.int.itemsize - 1 - self.mant)) - 2
        return top, self.tiny + self.bias - top


_F32 = _Layout(np.dtype(np.float32), np.dtype(np.int32), 23, 127)
_F64 = _Layout(np.dtype(np.float64), np.dtype(np.int64), 52, 1023)


def _layout(*dtypes) -> _Layout:
    for d in dtypes:
        if not jnp.issubdtype(d, jnp.floating):
            raise PolyampError(f"cannot bin a {np.dtype(d)} array; accepted: floating-point dtypes")
    return _F64 if any(np.dtype(d).itemsize > 4 for d in dtypes) else _F32


def _magnitude_bits(x, lay: _Layout):
    """Flat magnitude bits of ``x`` widened exactly to ``lay``'s float (bfloat16 by shifting its bits:
    XLA's conversion may flush its subnormals)."""
    x = jnp.ravel(x)
    if x.dtype == jnp.bfloat16 and lay is _F32:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) << 16
    else:
        bits = lax.bitcast_convert_type(x.astype(lay.float), lay.int)
    return bits & jnp.asarray(lay.inf | (lay.normal - 1), lay.int)


def _reduce(maxima: list, minima: list) -> list:
    """Max of each of ``maxima`` and min of each of ``minima`` (int arrays) in one variadic reduction:
    XLA on CPU vectorises it, unlike a lone integer max (10x faster), and compiles one kernel."""
    n = len(maxima)
    lows = [np.iinfo(x.dtype).min for x in maxima]
    highs = [np.iinfo(x.dtype).max for x in minima]
    inits = [np.asarray(v, x.dtype) for v, x in zip([*lows, *highs], [*maxima, *minima])]

    def combine(p, q):
        return tuple(jnp.maximum(a, b) if i < n else jnp.minimum(a, b) for i, (a, b) in enumerate(zip(p, q)))

    return list(lax.reduce(tuple([*maxima, *minima]), tuple(inits), combine, (0,)))


def _hist_elements(a, lay: _Layout):
    """Each element's slot (``doctor/binning.py``), and the keys of the extremes: [amax bits] maxima,
    [amin non-zero bits] minima."""
    finite = a < lay.inf
    big = np.iinfo(lay.int).max
    slots = core.value_slots(xp, a, lay.width)
    return slots, [jnp.where(finite, a, 0)], [jnp.where(finite & (a > 0), a, big)]


def _ratio_elements(au, aw, lay: _Layout):
    """Each element's slot for ``|u| / 2^b(w)`` (``doctor/binning.py``), and the keys of the extremes. The
    ratio is ``(1 + m / 2^mant) * 2^s``, ``s = b(u) - b(w)`` within +-276 for float32, more than an int32
    key ``s << 23 | m`` holds; the extremes are those of ``clamp(s + o, -255, 254) << 23 | m`` for o = -22
    and +22 (float64: int64, 52, -2047..2046, 51): maxima [with -22, with +22], minima [with +22, with
    -22]; ``_decode`` takes the one in whose window the extreme lies unclamped."""
    slots, counted, shift, pu = core.ratio_parts(xp, au, aw, lay.width)
    mant = pu & (lay.normal - 1)
    top, offset = lay.window
    info = np.iinfo(lay.int)

    def keys(o, none):
        return jnp.where(counted, (jnp.clip(shift + o, -top - 1, top) << lay.mant) | mant, none)

    maxima = [keys(-offset, info.min), keys(offset, info.min)]
    return slots, maxima, [keys(offset, info.max), keys(-offset, info.max)]


def _elements(arrays: list, kind: str, lay: _Layout):
    """(slots, maxima, minima) of flat arrays: [x] ("hist"), [u, w] ("ratio") or [new, old] ("update":
    u = new - old, w = old, computed here so that the difference is never stored whole)."""
    if kind == "hist":
        return _hist_elements(_magnitude_bits(arrays[0], lay), lay)
    u, w = arrays
    if kind == "update":
        u = u.astype(lay.float) - w.astype(lay.float)
    return _ratio_elements(_magnitude_bits(u, lay), _magnitude_bits(w, lay), lay)


def _accumulate(carry, slots, maxima, minima, valid=None):
    counts, hi, lo = carry
    if valid is not None:  # a chunk's elements that an earlier chunk counted: to the IGNORE slot
        slots = jnp.where(valid, slots, IGNORE)
        maxima = [jnp.where(valid, k, np.iinfo(k.dtype).min) for k in maxima]
        minima = [jnp.where(valid, k, np.iinfo(k.dtype).max) for k in minima]
    counts = lax.scatter_add(counts, slots.astype(jnp.uint16)[:, None], jnp.ones(slots.shape, jnp.int32),
                             _SCATTER, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)  # fmt: skip
    ends = _reduce(maxima, minima)
    hi, lo = jnp.maximum(hi, jnp.stack(ends[: len(maxima)])), jnp.minimum(lo, jnp.stack(ends[len(maxima) :]))
    return counts, hi, lo


def _stats(parts: list[list], kind: str, lay: _Layout):
    """(counts[_SLOTS], maxima, minima) of several arrays (``parts``: one list of ``_elements``' arrays
    each) binned as one. Arrays over ``_CHUNK`` elements run in a loop over chunks (the last one shifted
    back to end at the array's end, its repeated elements masked): XLA's scatter is 2x faster on a
    cache-sized index array than on one it must first write to memory. The smaller ones are joined."""
    n_keys = 1 if kind == "hist" else 2
    info = np.iinfo(lay.int)
    carry = (jnp.zeros(_SLOTS + 1, jnp.int32), jnp.full(n_keys, info.min, lay.int),
             jnp.full(n_keys, info.max, lay.int))  # fmt: skip
    small = [[jnp.ravel(a) for a in arrays] for arrays in parts if arrays[0].size <= _CHUNK]
    if small:
        joined = [jnp.concatenate(column) if len(small) > 1 else column[0] for column in zip(*small)]
        carry = _accumulate(carry, *_elements(joined, kind, lay))
    for arrays in parts:
        n = arrays[0].size
        if n <= _CHUNK:
            continue
        flat = [jnp.ravel(a) for a in arrays]

        def body(i, carry, flat=flat, n=n):
            start = jnp.minimum(i * _CHUNK, n - _CHUNK)
            chunk = [lax.dynamic_slice(a, (start,), (_CHUNK,)) for a in flat]
            valid = start + lax.iota(jnp.int32, _CHUNK) >= i * _CHUNK if n % _CHUNK else None
            return _accumulate(carry, *_elements(chunk, kind, lay), valid)

        carry = lax.fori_loop(0, -(-n // _CHUNK), body, carry)
    counts, hi, lo = carry
    return counts[:_SLOTS], jnp.concatenate([hi, lo])


def _decode(extremes: np.ndarray, lay: _Layout, ratio: bool) -> tuple[float, float | None]:
    """(amax, amin_nonzero) from a group's extremes (on the host)."""
    info = np.iinfo(lay.int)
    if not ratio:
        hi, lo = (int(v) for v in extremes)
        value = np.array([hi, lo if lo != info.max else 0], lay.int).view(lay.float).tolist()
        return value[0], (value[1] if lo != info.max else None)
    top, offset = lay.window
    hi_a, hi_b, lo_a, lo_b = (int(v) for v in extremes)

    def value(k: int, o: int) -> float:  # (1 + m / 2^mant) * 2^s, rounded once as numpy's ldexp
        s, m = (k >> lay.mant) - o, k & (lay.normal - 1)
        try:
            return min(math.ldexp(1.0 + m / lay.normal, s), float(np.finfo(np.float64).max))
        except OverflowError:
            return float(np.finfo(np.float64).max)

    if hi_b == info.min:  # no element has a ratio
        return 0.0, None
    amax = value(hi_a, -offset) if hi_a >> lay.mant > -top - 1 else value(hi_b, offset)
    amin = value(lo_a, offset) if lo_a >> lay.mant < top else value(lo_b, -offset)
    return amax, (amin or None)  # a float64 ratio below 2^-1074 leaves amin unknown, as in the core


def _histogram(counts: np.ndarray, extremes: np.ndarray, lay: _Layout, ratio: bool) -> LogHistogram:
    """A LogHistogram from the counts and extremes that the program brought back."""
    amax, amin = _decode(extremes, lay, ratio)
    counts = np.asarray(counts, np.int64)
    return LogHistogram.from_counts(counts[:N_BINS], int(counts[ZEROS]), int(counts[NONFINITE]), amax, amin,
                                    apart=int(counts[APART]))  # fmt: skip


@functools.partial(jax.jit, static_argnums=1)
def _hist_jit(x, lay):
    return _stats([[x]], "hist", lay)


@functools.partial(jax.jit, static_argnums=2)
def _ratio_jit(u, w, lay):
    return _stats([[u, w]], "ratio", lay)


def histogram(x) -> LogHistogram:
    """The ``LogHistogram`` of a floating jax array, binned by XLA (module docstring)."""
    lay = _layout(_check_array(x, "x").dtype)
    return _histogram(*jax.device_get(_hist_jit(x, lay)), lay, ratio=False)


def ratio_histogram(update, weight) -> LogHistogram:
    """``update_ratio_histogram(update, weight)`` of the core, binned by XLA."""
    u, w = _check_array(update, "update"), _check_array(weight, "weight")
    if u.shape != w.shape:
        raise PolyampError(f"update shape {u.shape} differs from weight's {w.shape}; expected the same")
    lay = _layout(u.dtype, w.dtype)
    return _histogram(*jax.device_get(_ratio_jit(u, w, lay)), lay, ratio=True)


def _check_array(x, name: str):
    if not isinstance(x, jax.Array):
        what = f"{type(x).__module__}.{type(x).__qualname__}"
        raise PolyampError(f"{name}: expected a jax array, got {what}; convert it with jnp.asarray")
    return x


# -- collect ---------------------------------------------------------------------------------------
