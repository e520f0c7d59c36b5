"""``quantize`` and ``quantize_blocks`` on JAX arrays, in JAX integer ops, bit-identical to the core.

``polyamp.quantize`` / ``polyamp.quantize_blocks`` call these for a JAX array (or tracer); they take
the same arguments and give the same values, bits and result dtype as ``polyamp.numerics.rounding``
/ ``blocks`` (read those docstrings for the rules). Everything traces: no Python branch depends on
the data, so both work under ``jax.jit`` on any device.

Why integers: float64 is off in JAX by default, and XLA's CPU backend flushes float32 subnormals to
zero (``1e-40 * 1.0 == 0`` there), so float arithmetic cannot reproduce the core. The algorithm is
``polyamp.numerics.exact_int``'s over this front end's ops (``xp_int.py``: uint32 significands; uint64 for
float64 input, which exists only with ``jax_enable_x64``); the grid and the MX scale rule are traced
arguments, so one compilation serves every format. Here only JAX's own parts: the core's splitmix64
stream of (seed, flat index + 1) computed in uint32 pairs (16-bit limbs for the 64-bit products) and
compared exactly as ``u * 2^(53 + s) < rem * 2^53`` in integers, and the jitted entry points.

Block formats of float32 or narrower input run in float64 XLA ops under a scoped ``jax.enable_x64``
(``blocks64.py``: several times faster, same bits); float64 input (x64 on) runs here, in integers
(``exact_int.block_values``). Limits: at most 2^32 - 1 elements per call (the stream's counter is
uint32); ``seed=None`` draws the seed when the function is traced, so a jitted function reuses it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import PolyampError
from ..numerics import exact_int
from ..numerics.grid import Grid as _Grid
from ..numerics.rounding import _MODE, INPUT_DTYPES, _result_dtype
from ..numerics.rounding import arguments as _arguments
from ..numerics.stream import GOLDEN, M1, M2
from ..numerics.stream import mix as _mix
from . import xp_int

_STOCHASTIC = _MODE["stochastic"]


def accepts(x) -> bool:
    """Whether ``x`` is an array this module quantizes (the core's dispatch asks)."""
    return isinstance(x, jax.Array)


def quantize(x, fmt, rounding: str = "nearest", saturate: bool = False, seed: int | None = None):
    """``polyamp.quantize`` for a JAX array: same values, bits and dtype rule, as JAX ops."""
    fmt, mode, saturate, seed = _arguments(fmt, rounding, saturate, seed)
    x = _input(x, "quantize")
    _check_size(x, mode)
    grid = _Grid.of(fmt, saturate).arrays()
    return _quantize(x, _key(seed), grid, mode=mode, dtype=_result_dtype(np.dtype(x.dtype), fmt).name)


@functools.partial(jax.jit, static_argnames=("mode", "dtype"))
def _quantize(x, key, grid, *, mode, dtype):
    stream = _Stream(key, x.shape) if mode == _STOCHASTIC else None
    rounded = exact_int.round_to_grid(xp_int, exact_int.decompose(xp_int, x), grid, mode, stream)
    return exact_int.compose(xp_int, rounded,
                             np.dtype(dtype))  # fmt: skip


def _key(seed) -> tuple[jax.Array, jax.Array]:
    """The stream's key ``_mix(seed)`` as a (hi, lo) uint32 pair: a traced argument, so a new seed
    does not recompile."""
    k = _mix(seed or 0)
    return jnp.asarray(np.uint32(k >> 32)), jnp.asarray(np.uint32(k & 0xFFFFFFFF))


def _check_size(x, mode) -> None:
    if mode == _STOCHASTIC and x.size >= 1 << 32:
        raise PolyampError(f"stochastic rounding on JAX takes at most 2^32 - 1 elements, got {x.size}")


@functools.partial(jax.jit, static_argnames=("bf", "axes", "shape", "mode"))
def _blocks_values(x, key, elem, rule, *, bf, axes, shape, mode):
    """The values of ``quantize_blocks`` (arguments checked): ``exact_int.block_values``; ``bf`` is None
    for MX formats (their element grid is ``elem``, their scale rule index ``rule``)."""
    stream = _Stream(key, x.shape) if mode == _STOCHASTIC else None
    u = jnp.uint64 if (x.dtype == jnp.float64 or jax.config.jax_enable_x64) else jnp.uint32
    return exact_int.block_values(xp_int, x, bf, elem, rule, axes, shape, mode, stream, u)


class _Stream:
    """The core's uniform stream ``_uniform53``: splitmix64 of ``key + (i + 1) * golden`` for the
    flat index ``i``, in uint32 (hi, lo) pairs; ``u = z53 / 2^53`` with ``z53 = z >> 11``."""

    def __init__(self, key: tuple[jax.Array, jax.Array], shape) -> None:
        n = int(np.prod(shape, dtype=np.int64))
        i = (lax.iota(jnp.uint32, max(n, 1))[:n] + np.uint32(1)).reshape(shape)
        zh, zl = _mul64(jnp.zeros_like(i), i, GOLDEN)
        zh, zl = _add64(zh, zl, *key)
        for shift, mult in ((30, M1), (27, M2)):
            zh, zl = _mul64(*_xor_shr(zh, zl, shift), mult)
        zh, zl = _xor_shr(zh, zl, 31)
        self.hi = zh >> 11  # z53 = (hi, lo): 21 + 32 bits
        self.lo = (zl >> 11) | (zh << 21)

    def below(self, rem, s) -> jax.Array:
        """``u < rem / 2^s`` exactly (rem < 2^s), as ``z53 * 2^s < rem * 2^53``."""
        k = 53 - s
        shl, shr = functools.partial(exact_int.shl, xp_int), functools.partial(exact_int.shr, xp_int)
        if xp_int.width(rem) == 64:
            z = (self.hi.astype(jnp.uint64) << 32) | self.lo.astype(jnp.uint64)
            small = z < shl(rem, k)
            large = (rem > 0) & (z <= shr(rem - 1, -k))
            return jnp.where(s <= 53, small, large)
        t_hi = jnp.where(k >= 32, shl(rem, k - 32), shr(rem, 32 - k)).astype(jnp.uint32)
        t_hi = jnp.where(k == 0, 0, t_hi).astype(jnp.uint32)
        t_lo = shl(rem, k)
        small = (self.hi < t_hi) | ((self.hi == t_hi) & (self.lo < t_lo))
        large = (rem > 0) & (self.hi == 0) & (self.lo <= shr(rem - 1, -k))
        return jnp.where(s <= 53, small, large)


def _mul32(a, b: int):
    """The 64-bit product of uint32 ``a`` and the constant ``b`` as (hi, lo), in 16-bit limbs."""
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + (p00 >> 16)
    mid2 = p10 + (mid & 0xFFFF)
    return p11 + (mid >> 16) + (mid2 >> 16), (mid2 << 16) | (p00 & 0xFFFF)


def _mul64(hi, lo, b: int):
    """``(hi, lo) * b mod 2^64`` for a 64-bit constant ``b``."""
    ph, pl = _mul32(lo, b & 0xFFFFFFFF)
    return ph + lo * np.uint32(b >> 32) + hi * np.uint32(b & 0xFFFFFFFF), pl


def _add64(hi, lo, b_hi, b_lo):
    out = lo + b_lo
    return hi + b_hi + (out < lo).astype(jnp.uint32), out


def _xor_shr(hi, lo, k: int):
    """``z ^ (z >> k)`` for 0 < k < 32."""
    return hi ^ (hi >> k), lo ^ ((lo >> k) | (hi << (32 - k)))


# -- argument checking ---------------------------------------------------------------------------------
def _input(x, name: str):
    if not isinstance(x, jax.Array):
        raise PolyampError(f"polyamp.jax.quantize.{name} takes a JAX array, got {type(x).__name__}")
    if np.dtype(x.dtype) not in INPUT_DTYPES:
        raise PolyampError(
            f"expected a floating-point array, got dtype {x.dtype}; accepted: "
            + ", ".join(str(d) for d in INPUT_DTYPES)
        )
    return x


__all__ = ["accepts", "quantize"]
