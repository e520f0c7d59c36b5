"""The measurement ops of ``doctor/blocks.py``'s ``measure_on`` for JAX arrays (``OPS``: ``xp``'s and these):
the cast by ``polyamp.jax.quantize``'s kernels, and the blocks' amaxes and the counts as XLA programs on
float32 bit patterns (XLA's CPU backend flushes subnormal floats in arithmetic and comparisons), the
sums in float64."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..doctor import blocks as _blocks
from . import xp


def block_amax(x, tiles) -> tuple[np.ndarray, np.ndarray]:
    return jax.device_get(_block_amax(x, tiles))


def measure_cast(x, cast: _blocks.Cast, block, scale):
    from .blocks64 import quantize_blocks
    from .quantize import _key
    from .recipe_operands import tensorwise

    if cast.scaling == "tensorwise":
        key = None if cast.seed is None else _key(cast.seed)  # the stream quantize(seed=...) draws
        return tensorwise(x, cast.format, scale=jnp.float32(scale), rounding=cast.rounding, key=key)
    axis = (-2, -1) if len(block) == 2 else -1
    return quantize_blocks(x, cast.format, axis=axis, block=block, scale_rule=cast.scale_rule,
                           rounding=cast.rounding, seed=cast.seed)  # fmt: skip


def block_stats(x, q, thr: np.ndarray, tiles, block_scaling: bool, spoiled: bool):
    """``measure_on``'s counts and sums as one program (``spoiled`` needs no other branch here)."""
    with jax.enable_x64(True):  # one program for the counts and the float64 sums
        return jax.device_get(_block_stats(x, q, thr.view(np.int32), tiles, block_scaling))


def _bits(xb):
    bits = lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF
    return bits, bits < 0x7F800000


@functools.partial(jax.jit, static_argnums=1)
def _block_amax(x, tiles):
    """Per block: the amax of the finite elements, and whether it holds inf/NaN."""
    xb, dims = _blocks.blocked(xp, x, tiles)
    bits, finite = _bits(xb)
    amax = lax.bitcast_convert_type(jnp.where(finite, bits, 0).max(dims, keepdims=True), jnp.float32)
    return amax, (~finite).any(dims, keepdims=True)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _block_stats(x, q, thr_bits, tiles, block_scaling: bool):
    """The non-finite, non-zero, underflow, clipped and spoiled counts (``blocks.measure``), and ``sum
    (q - x)^2`` and ``sum x^2`` in float64 over the finite elements outside spoiled blocks (x64 on)."""
    xb, dims = _blocks.blocked(xp, x, tiles)
    bits, finite = _bits(xb)
    qb = _blocks.blocked(xp, q, tiles)[0]
    qbits, _ = _bits(qb)
    bad = (~finite).any(dims, keepdims=True)
    good = finite & ~bad if block_scaling else finite
    nonzero = finite & (bits != 0)
    ok = nonzero & good
    under, clip = (ok & (qbits == 0)).sum(), (ok & (bits > thr_bits)).sum()
    counts = jnp.stack([(~finite).sum(), nonzero.sum(), under, clip, (nonzero & ~good).sum()])
    x64, q64 = xb.astype(jnp.float64), qb.astype(jnp.float64)
    d, e = jnp.where(good, q64 - x64, 0.0), jnp.where(good, x64, 0.0)
    return counts, jnp.stack([(d * d).sum(), (e * e).sum()])


OPS = types.SimpleNamespace(measured=xp.measured, numel=xp.numel, zero_pad_end=xp.zero_pad_end,
                            block_amax=block_amax, measure_cast=measure_cast, block_stats=block_stats)
