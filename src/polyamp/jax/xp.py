"""jax's array primitives: the ops layer polyamp's framework-neutral algorithms run over.

Only jax's vocabulary lives here (as in Keras 3's ``keras/src/backend/<name>/``): each algorithm
(exact rounding and block formats, the doctor's binning, Hadamard tiles, the recipes' GEMM rule) is
written once in the core over the functions of a module like this one. ``polyamp.frameworks.ops_of``
finds this module from a jax.Array.
"""

from __future__ import annotations

import jax

from .xp_int import bit_and as bit_and  # the integer vocabulary is part of these ops
from .xp_int import clamp_int as clamp_int
from .xp_int import select as select
from .xp_int import shift_right as shift_right
from .xp_int import zero_pad_end as zero_pad_end

NAME = "jax"


def accepts(x) -> bool:
    """Whether ``x`` is an array of this framework the core's algorithms take."""
    return isinstance(x, jax.Array)


def round_to_format(x, fmt, mode, saturate, seed):
    """``polyamp.quantize`` on a jax array, its arguments checked by the core (``fmt`` a FloatFormat,
    ``mode`` the rounding's code, ``seed`` an int or None)."""
    from ..numerics.rounding import ROUNDINGS
    from .quantize import quantize as run

    return run(x, fmt, ROUNDINGS[mode], saturate, seed)


def round_to_blocks(x, bf, axes, shape, rule, mode, seed):
    """``polyamp.quantize_blocks`` on a jax array, its arguments checked by the core (``bf`` a BlockFormat,
    ``axes`` / ``shape`` the blocked axes and block shape, ``rule`` the scale rule or None)."""
    from ..numerics.rounding import ROUNDINGS
    from .blocks64 import quantize_blocks as run

    return run(x, bf.name, axes if len(axes) > 1 else axes[0], shape, rule, ROUNDINGS[mode], seed)


# -- binning (the doctor) ------------------------------------------------------------------------------
# the measured block formats (``doctor.blocks.measure_on``, with ``doctor_measure.py``'s programs)
def measured(t):
    """``t``'s values as float32, at least one axis."""
    x = jax.numpy.asarray(t).astype("float32")
    return x.reshape(x.shape if x.ndim else (1,))


def numel(x) -> int:
    return int(x.size)


def float_bits(x):
    """The bits of the float array ``x`` as the int of its width."""
    return jax.lax.bitcast_convert_type(x, "int32" if x.dtype.itemsize == 4 else "int64")


def int_float(a):
    """The int array ``a`` converted to the float of its width."""
    return a.astype("float32" if a.dtype.itemsize == 4 else "float64")


# -- Hadamard tiles and the recipes' GEMM rule ---------------------------------------------------------
def tensor_facts(x) -> tuple[str, tuple]:
    """``x``'s dtype name and (static) shape."""
    return x.dtype.name, tuple(x.shape)


def float32_tiles(x, axis: int, tile: int):
    """``x`` as float32, ``axis`` zero padded at its end to a multiple of ``tile`` and split in place into
    ``[tiles, tile]``."""
    v = x.astype(jax.numpy.float32)
    pad = [(0, 0)] * v.ndim
    pad[axis] = (0, -v.shape[axis] % tile)
    v = jax.numpy.pad(v, pad)
    return v.reshape(*v.shape[:axis], v.shape[axis] // tile, tile, *v.shape[axis + 1 :])


def times(t, c):
    """``t * c``, ``c`` a numpy float32 constant broadcast against ``t``."""
    return t * c


def butterfly(t, axis: int, h: int):
    """In each group of ``2h`` along ``axis``, the first ``h`` (``a``) and the next ``h`` (``b``) become
    ``a + b`` and ``a - b``."""
    pairs = t.reshape(*t.shape[:axis], t.shape[axis] // (2 * h), 2, h, *t.shape[axis + 1 :])
    a, b = (jax.lax.index_in_dim(pairs, i, axis + 1, keepdims=False) for i in (0, 1))
    return jax.numpy.stack([a + b, a - b], axis=axis + 1).reshape(t.shape)


def merge_tiles(t, axis: int):
    """``t`` with ``axis`` and ``axis + 1`` merged into one."""
    return t.reshape(*t.shape[:axis], t.shape[axis] * t.shape[axis + 1], *t.shape[axis + 2 :])


# -- optimizer state codes (``numerics.state_codes``) -------------------------------------------------
def const(value: float, like):
    return value


def size(v) -> int:
    return int(v.size)


def abs(v):  # noqa: A001 - the ops vocabulary
    return jax.numpy.abs(v)


def reshape(v, shape):
    return v.reshape(shape)


def pad_end(v, widths):
    return jax.numpy.pad(v, [(0, w) for w in widths])


def amax(v, axes):
    return v.max(axis=axes) if v.size else v.sum(axis=axes)


def where(cond, a, b):
    return jax.numpy.where(cond, a, b)


def clip(v, lo, hi):
    return jax.numpy.clip(v, lo, hi)


def cast(v, dtype: str):
    return v.astype(dtype)


def take(table, codes):
    """``table[codes]``: the numpy ``table``'s entries at integer ``codes``."""
    return jax.numpy.asarray(table)[codes.astype("int32")]


def high16(v):
    """The top 16 bits of float32 ``v`` (sign, exponent, 7 fraction bits) as integers."""
    return jax.lax.bitcast_convert_type(v.astype("float32"), "uint32") >> 16


def unpack4(codes):
    """Two 4-bit codes per byte (low nibble first) -> one code per uint8, the last axis doubled."""
    return jax.numpy.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)


def moveaxis(v, src, dst):
    return jax.numpy.moveaxis(v, src, dst)
