"""Block formats of JAX arrays: ``quantize_blocks``; float32 (or narrower) input in float64 XLA ops, the
integer route's bits, faster.

``quantize.py`` reproduces the core with integer ops only, because XLA's CPU backend flushes float32
subnormals and float64 is off by default; its NVFP4 quotients are long divisions (57 steps each for
stochastic rounding). This route runs where float64 is on (``blocks_keyed`` enables it for
the call) and follows the core's own float64 arithmetic, as torch's ``_mx_plane`` / ``_nvfp4_plane`` do:

1. per block, as the integer route (``numerics.exact_int`` on the per-block values: cheap): MX, the E8M0
   exponent ``k`` (``scale = 2^k``); NVFP4, the float32 global scale ``g``, the e4m3 block scale ``s``
   (``scale = s * g``, exact in float64);
2. each element as float64 from its bit pattern by integer ops (a float32 subnormal is a normal
   float64, but XLA's conversion would flush it); ``t = x * 2^-k`` (MX, exact) or ``x / (s * g)`` in one
   correctly rounded float64 division (NVFP4): the core's ``t``;
3. nearest: ``(|t| + c) - c`` with ``c = 2^(max(E, emin) - m + 52)``, ``E`` the exponent of ``|t|``, ``m``
   the element's mantissa bits: float64's addition rounds ``|t|`` to the element's spacing
   ``2^(max(E, emin) - m)`` there, ties to even, as the core's rounding does; stochastic: ``floor(v) +
   (u < v - floor(v))`` for ``v = |t| / spacing`` (exact), ``u`` the core's splitmix64 stream
   (``rounding._uniform53``, uint64 ops) at the element's flat index; both clamped to the element's
   max (saturation), signed as ``t``;
4. ``element * scale`` is exact in float64 and rounds once to float32. XLA's conversion is that
   rounding except for results in float32's subnormal range, which it flushes: those exist only when
   the smallest non-zero result ``2^(emin - m) * scale`` of some block is below 2^-126, and then the
   exact integer conversion runs instead (``lax.cond``: one branch executes).

A block holding NaN or inf gives NaN, a block of zeros (or whose NVFP4 ``s`` rounds to 0) ``+-0``, as in
the core. Blocks are split in place along their axes (no transposed copies).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..numerics import blocks as _core_blocks
from ..numerics import exact_int
from ..numerics.exact_int import Num
from ..numerics.grid import Grid
from ..numerics.stream import GOLDEN, M1, M2
from . import quantize as _q
from . import xp_int

_EXP64 = 0x7FF << 52
_SIGN64 = 1 << 63


def quantize_blocks(x, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                    rounding: str = "nearest", seed: int | None = None):  # fmt: skip
    """``polyamp.quantize_blocks`` for a JAX array: same values and bits, float32 unless x is float64."""
    bf, mode, seed, rule = _core_blocks.arguments(fmt, scale_rule, rounding, seed)
    x = _q._input(x, "quantize_blocks")
    _q._check_size(x, mode)
    shape = _core_blocks._block_shape(bf, block)
    axes = _core_blocks._axes(axis, x.ndim, len(shape))
    return blocks_keyed(x, _q._key(seed), bf, axes, shape, rule, mode)


def blocks_keyed(x, key, bf, axes, shape, rule, mode, order=None):
    """``quantize_blocks``' values (arguments checked) with the stream's key in place of the seed; with
    ``order``, stochastic rounding indexes elements by their position in ``x.transpose(order)``. NVFP4 of
    float32 or narrower input takes the float64 route (here), float64 input the integer one."""
    mx = bf.scale.name == "e8m0fnu"
    code = _core_blocks.SCALE_RULES.index(rule) if mx else 0
    if mode != _q._STOCHASTIC:  # only the stream's indices depend on the order: one compilation for both
        order = None
    if x.dtype != jnp.float64:
        with jax.enable_x64(True):  # scoped: float64 and uint64 for this call only
            return values_jit(x, key, bf=bf, rule=code, axes=axes, shape=shape,
                                       stochastic=mode == _q._STOCHASTIC, order=order)  # fmt: skip
    if order is not None:  # the integer route indexes x's own layout: quantize the transposed copy
        back = tuple(np.argsort(order))
        moved = tuple(order.index(a) for a in axes)
        return jnp.transpose(blocks_keyed(jnp.transpose(x, order), key, bf, moved, shape, rule, mode), back)
    # the element grid and the scale rule are traced, so one compilation serves every MX format
    elem = Grid.of(bf.element, True).arrays()
    return _q._blocks_values(
        x, key, elem, np.int32(code), bf=None if mx else bf, axes=axes, shape=shape, mode=mode
    )


def values(x, key, bf, rule, axes, shape, stochastic: bool, order=None):
    """``quantize_blocks(x, bf, ...)`` for float16 / bfloat16 / float32 ``x`` (float64 enabled): float32
    values, the bits of ``quantize._blocks_values``; ``rule``: the MX scale rule's index in
    ``SCALE_RULES`` (unused by NVFP4); ``key``: the stream's (hi, lo) key. ``order``: stochastic
    rounding indexes the elements by their flat position in ``x.transpose(order)`` (the recipes quantize
    ``g^T`` as ``g`` blocked along axis 0: no transposed copy); default ``x``'s."""
    blocked = _split(xp_int.bits(x), axes, shape)
    abs_bits = blocked & ~xp_int.sign_mask(x.dtype)
    inf_bits = xp_int.inf_bits(x.dtype)
    amax_bits = jnp.max(abs_bits, axis=_inner(x.ndim, axes), keepdims=True, initial=0)
    bad = amax_bits >= inf_bits
    amax = exact_int.decompose_bits(xp_int, jnp.where(bad, 0, amax_bits), x.dtype, jnp.uint64)
    elem = bf.element
    if bf.scale.name == "e8m0fnu":
        k = exact_int.mx_exponent(xp_int, amax, Grid.of(elem, True), np.int32(rule))
        scale = _pow2(k.astype(jnp.int64))
        lowest = jnp.min(jnp.where((amax_bits == 0) | bad, 127, k))
    else:
        g = exact_int.nvfp4_global_of_bits(xp_int, abs_bits, inf_bits, x.dtype, jnp.uint64)
        s = exact_int.nvfp4_scales(xp_int, amax, g, bf)
        scale = _float64(Num(s.neg, s.sig * g.sig, s.exp + g.exp, s.nan, s.inf))
        lowest = g.exp + xp_int.msb(g.sig) + bf.scale.emin - bf.scale.mbits  # the least s * g's exponent
    # a result below 2^-126 needs the exact conversion; the conditional's operands are also where XLA
    # stops fusing: the per-block and global scales would otherwise be recomputed in every element's loop
    tiny = lowest + (elem.emin - elem.mbits) < -126
    index = functools.partial(_index, x.shape, order or tuple(range(x.ndim)), axes, shape)
    run = functools.partial(_elements, elem=elem, dtype=x.dtype, index=index if stochastic else None)
    out = lax.cond(tiny, functools.partial(run, exact=True), functools.partial(run, exact=False),
                   blocked, jnp.where(bad, jnp.nan, scale), key)  # fmt: skip
    return _merge(out, x.shape, axes, shape)


values_jit = jax.jit(values, static_argnames=("bf", "rule", "axes", "shape", "stochastic", "order"))


def _elements(bits, scale, key, *, elem, dtype, index, exact: bool):
    """Steps 2-4 (module docstring) for the blocked bit patterns ``bits`` and the per-block ``scale``
    (NaN for a bad block; NVFP4: 0 where ``s`` rounds to 0); ``index()``: the stream's flat indices
    (stochastic rounding), or None (nearest)."""
    x64 = _float64(exact_int.decompose_bits(xp_int, bits, dtype, jnp.uint64))
    t = x64 / jnp.where((scale == 0) | jnp.isnan(scale), 1.0, scale)  # MX: by 2^k, exact
    t_bits = lax.bitcast_convert_type(t, jnp.uint64)
    a = jnp.abs(t)
    if index is not None:
        biased = jnp.clip(t_bits << 1 >> 53, elem.emin + 1023, elem.emax + 1024).astype(jnp.int64)
        e = biased - 1023 - elem.mbits  # the spacing 2^e at |t|
        v = a * _pow2(-e)
        f = jnp.floor(v)
        r = (f + (_uniform(key, index()) < v - f)) * _pow2(e)
    else:
        least = np.uint64((elem.emin + 1023) << 52)
        c_bits = jnp.maximum(t_bits & np.uint64(_EXP64), least) + np.uint64((52 - elem.mbits) << 52)
        c = lax.bitcast_convert_type(c_bits, jnp.float64)
        r = (a + c) - c
    r = jnp.minimum(r, float(elem.max))
    sign = t_bits & np.uint64(_SIGN64)
    r = lax.bitcast_convert_type(lax.bitcast_convert_type(r, jnp.uint64) | sign, jnp.float64)
    v64 = r * scale
    out = _exact_float32(v64) if exact else v64.astype(jnp.float32)
    return jnp.where(jnp.isnan(scale), jnp.float32(jnp.nan), out)


def _split(a, axes, shape):
    """``a`` with each blocked axis zero padded to a multiple of its block and split in place into
    (count, block): no axis moves, so a block along a leading axis needs no transposed copy."""
    pad, split = [], []
    for ax, n in enumerate(a.shape):
        b = shape[axes.index(ax)] if ax in axes else None
        pad.append((0, -n % b) if b else (0, 0))
        split += [-(-n // b), b] if b else [n]
    return jnp.pad(a, pad).reshape(split)


def _inner(ndim: int, axes) -> tuple[int, ...]:
    """The positions of the block axes in ``_split``'s layout."""
    out, pos = [], 0
    for ax in range(ndim):
        if ax in axes:
            out.append(pos + 1)
        pos += 2 if ax in axes else 1
    return tuple(out)


def _merge(b, full, axes, shape):
    """The inverse of ``_split``: merge each (count, block) pair and drop the padding."""
    padded = [n + (-n % shape[axes.index(ax)]) if ax in axes else n for ax, n in enumerate(full)]
    return b.reshape(padded)[tuple(slice(0, n) for n in full)]


def _index(full, order, axes, shape):
    """The flat index of each element of ``x`` (shape ``full``) in ``x.transpose(order)``, uint64, in
    ``_split``'s layout (the padding's indices are arbitrary: its values are dropped)."""
    strides = {}
    step = 1
    for ax in reversed(order):
        strides[ax] = step
        step *= full[ax]
    padded = [n + (-n % shape[axes.index(ax)]) if ax in axes else n for ax, n in enumerate(full)]
    index = sum(
        lax.broadcasted_iota(jnp.uint64, padded, ax) * np.uint64(strides[ax]) for ax in range(len(full))
    )
    return _split(index, axes, shape)


def _float64(num: Num):
    """A finite ``Num`` (uint64 significand) as float64, by its bit pattern."""
    return exact_int.compose(xp_int, num._replace(nan=jnp.zeros_like(num.nan), inf=jnp.zeros_like(num.inf)),
                             xp_int.FLOAT64)  # fmt: skip


def _pow2(k):
    """2.0^k for int64 ``k`` in float64's normal range, from exponent bits."""
    return lax.bitcast_convert_type(((k + 1023).astype(jnp.uint64)) << 52, jnp.float64)


def _exact_float32(v64):
    """float64 to float32 rounded to nearest even, subnormals included (XLA's conversion flushes them)."""
    num = exact_int.decompose(xp_int, v64, jnp.uint64)
    rounded = exact_int.round_to_grid(xp_int, num, exact_int.FP32, exact_int.NEAREST, None)
    return exact_int.compose(xp_int, rounded,
                             xp_int.FLOAT32)  # fmt: skip


def _uniform(key, index):
    """``rounding._uniform53`` at each flat ``index``: splitmix64 of ``key + (index + 1) * golden``."""
    hi, lo = key
    z = (hi.astype(jnp.uint64) << 32 | lo.astype(jnp.uint64)) + (index + np.uint64(1)) * np.uint64(GOLDEN)
    z = (z ^ (z >> 30)) * np.uint64(M1)
    z = (z ^ (z >> 27)) * np.uint64(M2)
    z = z ^ (z >> 31)
    return (z >> 11).astype(jnp.float64) * 2.0**-53
