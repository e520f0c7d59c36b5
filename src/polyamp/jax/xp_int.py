"""jax's integer vocabulary of the ops layer: what ``polyamp.numerics.exact_int`` (exact rounding and
block formats on integers, uint32 significands, uint64 under x64) runs over.

Part of the ops layer with ``xp.py``; apart from it because ``xp.py``'s entry points
(``round_to_format``, ``round_to_blocks``) call ``quantize.py``, which runs over this module: one module
would import itself back through ``quantize.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

# float dtype -> (exponent bits, mantissa bits)
LAYOUT = {np.dtype(np.float16): (5, 10), np.dtype(ml_dtypes.bfloat16): (8, 7),
          np.dtype(np.float32): (8, 23), np.dtype(np.float64): (11, 52)}  # fmt: skip
UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
FLOAT32, FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)


def layout(dtype) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of a float dtype."""
    return LAYOUT[np.dtype(dtype)]


def bits(x):
    """The bit pattern of a float array, as the unsigned int of its width."""
    return lax.bitcast_convert_type(x, UINT[x.dtype.itemsize])


def widen(b, u=None):
    """Bit patterns as significands of type ``u`` (default uint64 for 64-bit patterns, else uint32)."""
    return b.astype(u or (jnp.uint64 if b.dtype.itemsize == 8 else jnp.uint32))


def abs_bits(x):
    """``|x|``'s bit patterns, in the unsigned int of x's width."""
    return bits(x) & ~sign_mask(x.dtype)


def sign_mask(dtype):
    """The sign bit of ``dtype``, in the unsigned int of its width."""
    return np.array(1 << (np.dtype(dtype).itemsize * 8 - 1)).astype(UINT[np.dtype(dtype).itemsize])


def inf_bits(dtype):
    """inf's bit pattern in ``dtype``, in the unsigned int of its width (``abs_bits``' type)."""
    e, m = layout(dtype)
    return np.array(((1 << e) - 1) << m).astype(UINT[np.dtype(dtype).itemsize])


def from_bits(u, dtype):
    """Unsigned bit patterns as the float ``dtype``."""
    dtype = np.dtype(dtype)
    return lax.bitcast_convert_type(u.astype(UINT[dtype.itemsize]), dtype)


def width(u) -> int:
    return jnp.iinfo(u.dtype).bits


def uint(c, like):
    """``c`` (a Python int, or a traced integer) as ``like``'s unsigned type."""
    if isinstance(c, int):
        return jnp.asarray(np.asarray(c, like.dtype))
    return jnp.asarray(c).astype(like.dtype)


def to_uint(v, like):
    """Flags or integers cast to ``like``'s unsigned type."""
    return v.astype(like.dtype)


def int32(v):
    return v.astype(jnp.int32)


def int32_scalar(c: int):
    return jnp.asarray(c, jnp.int32)


def flag(c: bool):
    return jnp.asarray(c)


def eq(a, b):
    return a == b


def ne(a, b):
    return a != b


def maximum(a, b):
    return jnp.maximum(a, b)


def shift_left(x, n: int):
    return x << n


def shift_left_by(u, s):
    """``u << s`` for int32 ``s`` in ``[0, width)``."""
    return u << s.astype(u.dtype)


def shift_right_by(u, s):
    """``u >> s`` (logical) for int32 ``s`` in ``[0, width)``."""
    return u >> s.astype(u.dtype)


def msb(u):
    """Index of the highest set bit (int32), -1 for 0."""
    return (width(u) - 1) - lax.clz(u).astype(jnp.int32)


def zeros_like(v):
    return jnp.zeros_like(v)


def shape(v):
    return v.shape


def broadcast_to(v, shape):
    return jnp.broadcast_to(v, shape)


def rank(v) -> int:
    return v.ndim


def dims(x) -> list:
    return list(x.shape)


def moveaxis(v, src, dst):
    return jnp.moveaxis(v, src, dst)


def reshape(v, shape):
    return v.reshape(shape)


def amax(v, axes):
    """max over ``axes``, 0 for an empty reduction."""
    return jnp.max(v, axis=axes, initial=0)


def max_all(v):
    """max of all elements, 0 for none."""
    return jnp.max(v, initial=0)


def repeat(v, b: int, axis: int, length: int):
    """Each entry repeated ``b`` times along ``axis``, cut to ``length``."""
    out = jnp.repeat(v, b, axis=axis, total_repeat_length=v.shape[axis] * b)
    return lax.slice_in_dim(out, 0, length, axis=axis)


def bit_and(x, m: int):
    return x & m


def clamp_int(x, lo: int, hi: int):
    return jax.numpy.clip(x, lo, hi)


def select(c, x, y):
    return jax.numpy.where(c, x, y)


def shift_right(x, n: int):
    return x >> n


def zero_pad_end(x, widths):
    """``x`` zero padded at the end of each axis by ``widths``."""
    return jax.numpy.pad(x, [(0, w) for w in widths])
