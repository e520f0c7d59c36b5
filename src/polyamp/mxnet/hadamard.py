"""NVFP4's 16x16 random Hadamard transform on MXNet NDArrays: the core's float32 steps as MXNet ops.

``polyamp.numerics.hadamard`` defines the transform; this runs its steps along the last axis of a
2-d NDArray (the recipe's ``g^T`` and ``x^T``), on its context: float32 of ``x``, zero padding to a
multiple of 16, the product with ``SIGNS``, the four butterfly stages (half-widths 1, 2, 4, 8; ``a + b``
/ ``a - b``), then ``* 0.25``, each one elementwise float32 operation, so the bits are the core's.
"""

from __future__ import annotations

import warnings

from ..numerics.hadamard import SIGNS, STAGES, TILE

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx


def hadamard_tiles(x):
    """``polyamp.numerics.hadamard_tiles(x, axis=-1)`` for a 2-d NDArray: float32, the last axis zero
    padded to a multiple of 16."""
    v = x.astype("float32")
    rows, n = v.shape
    if n % TILE:
        v = mx.nd.concat(v, mx.nd.zeros((rows, -n % TILE), ctx=v.context, dtype="float32"), dim=1)
    signs = mx.nd.array(SIGNS, ctx=v.context, dtype="float32").reshape((1, 1, TILE))
    t = mx.nd.broadcast_mul(v.reshape((rows, -1, TILE)), signs)
    for h in STAGES:
        pairs = t.reshape((rows, -1, TILE // (2 * h), 2, h))
        a, b = (mx.nd.slice_axis(pairs, axis=3, begin=i, end=i + 1) for i in (0, 1))
        t = mx.nd.concat(a + b, a - b, dim=3)
    return (t * 0.25).reshape((rows, -1))
