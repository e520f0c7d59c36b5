"""NVFP4's 16x16 random Hadamard transform on TF tensors: the core's float32 steps as TF ops.

``polyamp.numerics.hadamard`` defines the transform; this runs its steps on a TF tensor (eager, in a
``tf.function`` or under XLA): float32 of ``x``, ``axis`` zero padded to a multiple of 16 and split in
place into tiles, the product with ``SIGNS``, the four butterfly stages (half-widths 1, 2, 4, 8;
``a + b`` / ``a - b``), then ``* 0.25``, each one elementwise float32 operation, so the bits are the
core's. One exception: TensorFlow on the CPU flushes float32 subnormals, so a tile whose inputs,
partial sums or results are subnormal differs from the core's there (as in JAX).
"""

from __future__ import annotations

import tensorflow as tf

from ..numerics.hadamard import SIGNS, STAGES, TILE


def hadamard_tiles(x, axis: int = -1) -> tf.Tensor:
    """``polyamp.numerics.hadamard_tiles`` for a TF tensor of static rank: float32, ``axis`` zero padded
    to a multiple of 16 (its length may be dynamic)."""
    v = tf.cast(x, tf.float32)
    rank = v.shape.rank
    axis %= rank
    paddings = [[0, 0]] * rank
    paddings[axis] = [0, tf.math.floormod(-tf.shape(v)[axis], TILE)]
    v = tf.pad(v, tf.stack([tf.stack(p) for p in paddings]))
    shape = tf.shape(v)
    lead, rest = shape[:axis], shape[axis + 1 :]
    signs = tf.reshape(tf.constant(SIGNS), [TILE] + [1] * (rank - axis - 1))
    t = tf.reshape(v, tf.concat([lead, [-1, TILE], rest], 0)) * signs
    for h in STAGES:
        pairs = tf.reshape(t, tf.concat([lead, [-1, TILE // (2 * h), 2, h], rest], 0))
        a, b = tf.unstack(pairs, num=2, axis=axis + 2)
        t = tf.stack([a + b, a - b], axis=axis + 2)
    return tf.reshape(t * 0.25, shape)
