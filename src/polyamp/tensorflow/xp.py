"""tensorflow's array primitives: the ops layer polyamp's framework-neutral algorithms run over.

Only tensorflow's vocabulary lives here (as in Keras 3's ``keras/src/backend/<name>/``): each algorithm
(exact rounding and block formats, the doctor's binning, Hadamard tiles, the recipes' GEMM rule) is
written once in the core over the functions of a module like this one. ``polyamp.frameworks.ops_of``
finds this module from a tf.Tensor / tf.Variable.
"""

from __future__ import annotations

import tensorflow as tf

from .xp_int import bit_and as bit_and  # the integer vocabulary is part of these ops
from .xp_int import clamp_int as clamp_int
from .xp_int import graph_const as graph_const
from .xp_int import select as select
from .xp_int import shift_right as shift_right

NAME = "tensorflow"


def accepts(x) -> bool:
    """Whether ``x`` is an array of this framework the core's algorithms take."""
    return isinstance(x, (tf.Tensor, tf.Variable))


def round_to_format(x, fmt, mode, saturate, seed):
    """``polyamp.quantize`` on a tensorflow array, its arguments checked by the core (``fmt`` a
    FloatFormat, ``mode`` the rounding's code, ``seed`` an int or None)."""
    from ..numerics.rounding import ROUNDINGS
    from .quantize import quantize as run

    return run(x, fmt, ROUNDINGS[mode], saturate, seed)


def round_to_blocks(x, bf, axes, shape, rule, mode, seed):
    """``polyamp.quantize_blocks`` on a tensorflow array, its arguments checked by the core (``bf`` a
    BlockFormat, ``axes`` / ``shape`` the blocked axes and block shape, ``rule`` the scale rule or None)."""
    from ..numerics.rounding import ROUNDINGS
    from .quantize import quantize_blocks as run

    return run(x, bf.name, axes if len(axes) > 1 else axes[0], shape, rule, ROUNDINGS[mode], seed)


# -- binning (the doctor) ------------------------------------------------------------------------------
def float_bits(x):
    """The bits of the float tensor ``x`` as the int of its width."""
    return tf.bitcast(x, tf.int32 if x.dtype == tf.float32 else tf.int64)


def int_float(a):
    """The int tensor ``a`` converted to the float of its width."""
    return tf.cast(a, tf.float32 if a.dtype == tf.int32 else tf.float64)


# -- Hadamard tiles and the recipes' GEMM rule ---------------------------------------------------------
def tensor_facts(x) -> tuple[str, tuple]:
    """``x``'s dtype name (numpy's spelling) and static shape (None where a length is dynamic)."""
    return x.dtype.name, tuple(x.shape.as_list())


def float32_tiles(x, axis: int, tile: int):
    """``x`` as float32, ``axis`` (of any length, static or not) zero padded at its end to a multiple of
    ``tile`` and split in place into ``[tiles, tile]``."""
    v = tf.cast(x, tf.float32)
    paddings = [[0, 0]] * v.shape.rank
    paddings[axis] = [0, tf.math.floormod(-tf.shape(v)[axis], tile)]
    v = tf.pad(v, tf.stack([tf.stack(p) for p in paddings]))
    shape = tf.shape(v)
    return tf.reshape(v, tf.concat([shape[:axis], [shape[axis] // tile, tile], shape[axis + 1 :]], 0))


def times(t, c):
    """``t * c``, ``c`` a numpy float32 constant broadcast against ``t``."""
    return t * c


def butterfly(t, axis: int, h: int):
    """In each group of ``2h`` along ``axis`` (static length), the first ``h`` (``a``) and the next ``h``
    (``b``) become ``a + b`` and ``a - b``."""
    shape = tf.shape(t)
    pairs = tf.reshape(t, tf.concat([shape[:axis], [t.shape[axis] // (2 * h), 2, h], shape[axis + 1 :]], 0))
    a, b = tf.unstack(pairs, num=2, axis=axis + 1)
    return tf.reshape(tf.stack([a + b, a - b], axis=axis + 1), shape)


def merge_tiles(t, axis: int):
    """``t`` with ``axis`` and ``axis + 1`` merged into one."""
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([shape[:axis], [shape[axis] * shape[axis + 1]], shape[axis + 2 :]], 0))
