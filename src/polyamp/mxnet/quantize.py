"""The recipes' per-tensor scaling on MXNet NDArrays, bit-identical to ``polyamp.recipes``, in MXNet ops.

Tensorwise (``recipes.quantize_tensorwise``): ``fp32(x * scale)`` rounded with saturation (the core's
float64 route, ``exact_float.round_float64``, over ``polyamp.mxnet.xp``), divided by ``scale`` in
float32; :func:`current_scale` is ``recipes.current_scale`` of an amax array, on the array's context.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from ..errors import PolyampError
from ..numerics import exact_float
from ..numerics.formats import get_format
from ..numerics.rounding import _MODE, _rounding, _seed
from ..recipes import current_scale_of
from . import xp

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx

mnp = mx.np


def current_scale(amax, fmt, margin: int = 0, eps: float = 0.0):
    """``polyamp.recipes.current_scale`` of a float32 amax array (``mx.np``, any shape), as MXNet ops."""
    return current_scale_of(xp, amax, fmt, margin, eps)


def amax(x) -> mx.np.ndarray:
    """max |x| as a float32 array of shape (1,) (NaN if x holds one)."""
    return mnp.max(mnp.abs(xp.as_np(x).astype("float32")), keepdims=True).reshape((1,))


def quantize_tensorwise(x, fmt, scale, rounding: str = "nearest", seed: int | None = None):
    """``polyamp.recipes.quantize_tensorwise`` for an NDArray: ``quantize(fp32(x * scale), fmt,
    saturate=True) / scale`` in float32; ``scale`` a float32 array of one element (``current_scale``)
    or a finite number > 0. Returns float32."""
    mode = _rounding(rounding)
    if mode == _MODE["stochastic"]:
        seed = _seed(seed)
    fmt = get_format(fmt)
    if isinstance(scale, mx.nd.NDArray):
        s = xp.as_np(scale).astype("float32").reshape((1,))
    else:
        if not (isinstance(scale, (int, float, np.floating)) and not isinstance(scale, bool)
                and 0 < scale < math.inf and np.isfinite(np.float32(scale))):  # fmt: skip
            raise PolyampError(f"scale must be a finite number > 0 (float32); received {scale!r}")
        s = mnp.array(np.array([scale], dtype=np.float32), ctx=x.ctx)
    v, _ = xp._input(x, "quantize_tensorwise")
    y = v.astype("float32") * s
    q = exact_float.round_float64(xp, y.astype("float64"), fmt, mode, True, seed or 0).astype("float32")
    return (q / s).as_nd_ndarray()


__all__ = ["amax", "current_scale", "quantize_tensorwise"]
