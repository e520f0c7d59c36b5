"""tensorflow's integer vocabulary of the ops layer: what ``polyamp.numerics.exact_int`` (exact rounding and
block formats on integers, uint64 significands) runs over.

Part of the ops layer with ``xp.py``; apart from it because ``xp.py``'s entry points
(``round_to_format``, ``round_to_blocks``) call ``quantize.py``, which runs over this module: one module
would import itself back through ``quantize.py``.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

# float dtype -> (exponent bits, mantissa bits, unsigned dtype of its width)
LAYOUT = {tf.float16: (5, 10, tf.uint16), tf.bfloat16: (8, 7, tf.uint16),
          tf.float32: (8, 23, tf.uint32), tf.float64: (11, 52, tf.uint64)}  # fmt: skip
U = tf.uint64
FLOAT32, FLOAT64 = tf.float32, tf.float64


def layout(dtype) -> tuple[int, int]:
    """(exponent bits, mantissa bits) of a float dtype."""
    return LAYOUT[dtype][:2]


def bits(x):
    """The bit pattern of a float tensor, as the unsigned int of its width."""
    return tf.bitcast(x, LAYOUT[x.dtype][2])


def widen(b, u=None):
    """Bit patterns as significands (uint64)."""
    return tf.cast(b, U)


def abs_bits(x):
    """``|x|``'s bit patterns, uint64."""
    e, m, _ = LAYOUT[x.dtype]
    return bit_and(widen(bits(x)), (1 << (e + m)) - 1)


def inf_bits(dtype):
    """inf's bit pattern in ``dtype``, a uint64 constant (``abs_bits``' type)."""
    e, m, _ = LAYOUT[dtype]
    return graph_const(((1 << e) - 1) << m, U)


def from_bits(u, dtype):
    """uint64 bit patterns as the float ``dtype``."""
    return tf.bitcast(tf.cast(u, LAYOUT[dtype][2]), dtype)


def width(u) -> int:
    return u.dtype.size * 8


def uint(c, like):
    """The integer ``c`` as a constant of ``like``'s unsigned type."""
    return graph_const(c, like.dtype)


def to_uint(v, like):
    """Flags or integers cast to ``like``'s unsigned type."""
    return tf.cast(v, like.dtype)


def int32(v):
    return tf.cast(v, tf.int32)


def int32_scalar(c: int):
    return graph_const(c, tf.int32)


def flag(c: bool):
    return graph_const(c, tf.bool)


def eq(a, b):
    return tf.equal(a, b)


def ne(a, b):
    return tf.not_equal(a, b)


def maximum(a, b):
    return tf.maximum(a, b)


def shift_left(x, n: int):
    return tf.bitwise.left_shift(x, graph_const(n, x.dtype))


def shift_left_by(u, s):
    """``u << s`` for int32 ``s`` in ``[0, width)``."""
    return tf.bitwise.left_shift(u, tf.cast(s, u.dtype))


def shift_right_by(u, s):
    """``u >> s`` for int32 ``s`` in ``[0, width)``."""
    return tf.bitwise.right_shift(u, tf.cast(s, u.dtype))


def msb(u):
    """Index of the highest set bit of a uint64 (int32), -1 for 0 (a binary search: TF has no clz)."""
    p, v = tf.zeros(tf.shape(u), tf.int32), u
    for k in (32, 16, 8, 4, 2, 1):
        t = shift_right(v, k)
        up = tf.not_equal(t, 0)
        p, v = tf.where(up, p + k, p), tf.where(up, t, v)
    return tf.where(tf.equal(u, 0), -1, p)


def zeros_like(v):
    return tf.zeros_like(v)


def shape(v):
    return tf.shape(v)


def broadcast_to(v, shape):
    return tf.broadcast_to(v, shape)


def rank(v) -> int:
    return v.shape.rank


def dims(x) -> list:
    """``x``'s dimensions: Python ints where the static shape knows them, else scalar tensors (a batch
    dimension ``model.fit`` leaves open)."""
    dynamic = None if x.shape.is_fully_defined() else tf.shape(x)
    return [n if n is not None else dynamic[i] for i, n in enumerate(x.shape.as_list())]


def moveaxis(v, src, dst):
    """``np.moveaxis`` as one transpose."""
    order = [a for a in range(v.shape.rank) if a not in src]
    for d, a in sorted(zip(dst, src)):
        order.insert(d, a)
    return tf.transpose(v, order)


def zero_pad_end(x, widths):
    """``x`` zero padded at the end of each axis by ``widths`` (ints or scalar tensors)."""
    pads = [[0, w] for w in widths]
    static = all(isinstance(w, int) for w in widths)
    return tf.pad(x, pads if static else tf.stack([tf.stack(p) for p in pads]))


def reshape(v, shape):
    """``v`` reshaped to ``shape`` (ints or scalar tensors)."""
    shape = list(shape)
    return tf.reshape(v, shape if all(isinstance(n, int) for n in shape) else tf.stack(shape))


def amax(v, axes):
    """max over ``axes``."""
    return tf.reduce_max(v, axis=list(axes))


def max_all(v):
    """max of all elements, 0 for none."""
    return tf.reduce_max(tf.concat([tf.reshape(v, [-1]), tf.zeros([1], v.dtype)], 0))


def repeat(v, b: int, axis: int, length):
    """Each entry repeated ``b`` times along ``axis``, cut to ``length`` (an int or a scalar tensor)."""
    out = tf.repeat(v, b, axis=axis)
    index = [slice(None)] * out.shape.rank
    index[axis] = slice(0, length)
    return out[tuple(index)]


def shift_right(x, n: int):
    return tf.bitwise.right_shift(x, graph_const(n, x.dtype))


_GRAPH_CONSTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_const(value, dtype):
    """``value`` as a constant (a tensor as it is), made once per graph while tracing (a graph of fewer
    ops builds faster)."""
    if tf.is_tensor(value):
        return value
    if tf.executing_eagerly():
        return tf.constant(value, dtype)
    made = _GRAPH_CONSTANTS.setdefault(tf.compat.v1.get_default_graph(), {})
    key = (tuple(value) if isinstance(value, list) else value, dtype)
    if key not in made:
        made[key] = tf.constant(value, dtype)
    return made[key]


def bit_and(x, m: int):
    return tf.bitwise.bitwise_and(x, graph_const(m, x.dtype))


def clamp_int(x, lo: int, hi: int):
    return tf.clip_by_value(x, graph_const(lo, x.dtype), graph_const(hi, x.dtype))


def select(c, x, y):
    """``tf.where``; a Python int takes the other operand's dtype."""
    dtype = (y if tf.is_tensor(y) else x).dtype
    return tf.where(c, graph_const(x, dtype), graph_const(y, dtype))
