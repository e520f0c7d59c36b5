"""Block-format and recipe measurement of a JAX array for the doctor (``doctor/blocks.py``'s
``measure`` with ``polyamp.jax.quantize``'s kernels): the blocks' amaxes go to the host for the clip
thresholds (``blocks.plan``), the counts are taken on float32 bit patterns, the sums in float64."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..doctor import blocks as _blocks


def measure_tensor(t, cast: _blocks.Cast) -> _blocks.Measured:
    """``blocks.measure`` of a JAX array with ``polyamp.jax.quantize``'s kernels: counts on the float32
    bit patterns (XLA's CPU backend flushes subnormal floats in arithmetic and comparisons), sums in
    float64, in a zero-padded blocked view (padding is zero: never counted)."""
    from .quantize import _key, quantize_blocks
    from .recipe import tensorwise

    x = jnp.asarray(t).astype(jnp.float32)
    x = x.reshape(x.shape if x.ndim else (1,))
    if not x.size:
        return _blocks.Measured()
    block = cast.block_for(x.ndim)
    tiles = block if cast.scaling == "block" else ()
    amax, bad = jax.device_get(_block_amax(x, tiles))
    thr, scale = _blocks.plan(cast, amax, bad)
    if cast.scaling == "tensorwise":
        key = None if cast.seed is None else _key(cast.seed)  # the stream quantize(seed=...) draws
        q = tensorwise(x, cast.format, scale=jnp.float32(scale), rounding=cast.rounding, key=key)
    else:
        axis = (-2, -1) if len(block) == 2 else -1
        q = quantize_blocks(x, cast.format, axis=axis, block=block, scale_rule=cast.scale_rule,
                            rounding=cast.rounding, seed=cast.seed)  # fmt: skip
    with jax.enable_x64(True):  # one program for the counts and the float64 sums
        counts, sums = jax.device_get(_block_stats(x, q, thr.view(np.int32), tiles, cast.scaling == "block"))
    nonfinite, nz, under, clip, spoiled = (int(c) for c in counts)
    err, energy = (float(v) for v in sums)
    return _blocks.Measured(int(x.size), nonfinite, nz, under, clip, spoiled, err, energy)


def _bits(xb):
    bits = lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF
    return bits, bits < 0x7F800000


@functools.partial(jax.jit, static_argnums=1)
def _block_amax(x, tiles):
    """Per block: the amax of the finite elements, and whether it holds inf/NaN."""
    xb, dims = _blocked(x, tiles)
    bits, finite = _bits(xb)
    amax = lax.bitcast_convert_type(jnp.where(finite, bits, 0).max(dims, keepdims=True), jnp.float32)
    return amax, (~finite).any(dims, keepdims=True)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _block_stats(x, q, thr_bits, tiles, block_scaling: bool):
    """The non-finite, non-zero, underflow, clipped and spoiled counts (``blocks.measure``), and ``sum
    (q - x)^2`` and ``sum x^2`` in float64 over the finite elements outside spoiled blocks (x64 on)."""
    xb, dims = _blocked(x, tiles)
    bits, finite = _bits(xb)
    qb = _blocked(q, tiles)[0]
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


def _blocked(x, block: tuple[int, ...]):
    """``x`` zero-padded and viewed as blocks, and the axes a block spans (``torch.doctor._blocked``)."""
    if not block:
        return x.reshape(1, -1), (1,)
    if len(block) == 1:
        (b,) = block
        x2 = x.reshape(-1, x.shape[-1])
        x2 = jnp.pad(x2, ((0, 0), (0, -x2.shape[1] % b)))
        return x2.reshape(x2.shape[0], -1, b), (2,)
    h, w = x.shape[-2:]
    x3 = jnp.pad(x.reshape(-1, h, w), ((0, 0), (0, -h % block[0]), (0, -w % block[1])))
    tiles = (x3.shape[0], x3.shape[1] // block[0], block[0], x3.shape[2] // block[1], block[1])
    return x3.reshape(tiles), (2, 4)
