"""The recipe's quantized GEMMs inside a hybridized Gluon graph: an MXNet custom operator.

A hybridized net runs a cached graph of symbols, which an ``mx.autograd.Function`` cannot enter. When a
watched Dense or Conv block is traced, its ``hybrid_forward`` emits ``F.Custom(weight, [bias], x,
op_type="polyamp_recipe", key=...)`` instead; the operator's ``forward`` / ``backward`` call the same
``QuantizedDense`` / ``QuantizedConv`` that the imperative path calls (``Layer`` adapts the input's rank
and dtype), so a hybridized net quantizes, rounds and updates the recipe's state exactly as the
imperative one does. The key names a ``Layer`` in this process's registry (``register`` / ``unregister``);
a graph traced before its layer was unregistered raises when it runs.

MXNet runs custom operators in a thread of its own, in the graph's dependency order: the quantize calls
of a sequential net come in the imperative order (so stochastic rounding draws the same seeds); in a
graph with parallel branches they follow the engine's schedule. A graph exported with the custom operator
loads only in a process that has this module and the layers registered.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

from ..errors import PolyampError
from .keep import dtype_name
from .recipe_operands import like

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    import numpy as np

OP_TYPE = "polyamp_recipe"
_LAYERS: dict[str, Layer] = {}
_KEYS = itertools.count()


class Layer:
    """One watched block as the graph operator runs it: ``make()`` a fresh autograd Function of the
    recipe (``QuantizedDense`` / ``QuantizedConv``) for each forward, which takes ``x`` in float32 (and,
    for a Dense, ``dense=(flatten, units)``, 2-D by the block's ``flatten`` rule, its output given back
    ``x``'s leading axes); ``dx`` comes back in ``x``'s shape and dtype. ``shapes(x_shape)`` is the
    weight's, the bias's and the output's shape (shape inference, deferred initialisation included). The
    operator's output is float32 holding the compute dtype's values (a bfloat16 output of a custom
    operator reads back as garbage in MXNet 1.9); ``custom`` casts it to the compute dtype."""

    def __init__(self, make, shapes, compute: str, dense: tuple[bool, int] | None = None):
        self.make, self.shapes, self.compute, self.dense = make, shapes, compute, dense

    def prepare(self, x):
        """``x`` as the Function takes it."""
        if self.dense is not None and x.ndim != 2:
            x = x.reshape((x.shape[0], -1)) if self.dense[0] else x.reshape((-1, x.shape[-1]))
        return like(x, "float32")

    def finish(self, y, x_shape):
        """The Function's output in the block's output shape."""
        return y.reshape(self.shapes(x_shape)[2]) if self.dense is not None else y

    def head(self, grad):
        """The output gradient in the shape of the Function's output."""
        return grad.reshape((-1, grad.shape[-1])) if self.dense is not None else grad


def register(layer: Layer) -> str:
    """A new key for ``layer``."""
    key = f"{next(_KEYS)}"
    _LAYERS[key] = layer
    return key


def unregister(key: str) -> None:
    _LAYERS.pop(key, None)


def custom(F, key: str, weight, bias, x):
    """The graph node of the layer ``key``: ``F.Custom`` of (weight, [bias], x), cast to the compute
    dtype (bfloat16 as the imperative output is, so the ops after it round as they do there)."""
    args = (weight, x) if bias is None else (weight, bias, x)
    y = F.Custom(*args, op_type=OP_TYPE, key=key, bias=str(bias is not None))
    return F.amp_cast(y, dtype="bfloat16") if _layer(key).compute == "bf16" else y


def _layer(key: str) -> Layer:
    layer = _LAYERS.get(key)
    if layer is None:
        raise PolyampError(f"a hybridized graph calls the recipe layer {key!r}, which mp.watch no longer "
                           "quantizes (watched again, or unwound): hybridize the net again")  # fmt: skip
    return layer


class _Operator(mx.operator.CustomOp):
    """Forward and backward of one layer's quantized GEMMs (the module docstring)."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key
        self.fn: Any = None

    def forward(self, is_train, req, in_data, out_data, aux):
        layer = _layer(self.key)
        *params, x = in_data
        self.x_shape, self.x_dtype = x.shape, dtype_name(x.dtype)
        self.fn = layer.make()
        y = self.fn.forward(*params, layer.prepare(x))
        _assign(out_data[0], req[0], layer.finish(y, self.x_shape))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        *params, dx = self.fn.backward(_layer(self.key).head(out_grad[0]))
        self.fn = None
        for i, g in enumerate((*params, like(dx.reshape(self.x_shape), self.x_dtype))):
            _assign(in_grad[i], req[i], g)


def _assign(dst, req: str, src) -> None:
    """``CustomOp.assign`` of ``src`` cast to ``dst``'s dtype."""
    if req != "null":
        src = like(src, dtype_name(dst.dtype))
        dst[:] = src if req == "write" else dst + src


@mx.operator.register(OP_TYPE)
class _Prop(mx.operator.CustomOpProp):
    def __init__(self, key, bias):
        super().__init__(need_top_grad=True)
        self.key, self.bias = key, bias == "True"

    def list_arguments(self):
        return ["weight", "bias", "x"] if self.bias else ["weight", "x"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        w, b, out = _layer(self.key).shapes(tuple(in_shape[-1]))
        return [w, b, in_shape[-1]] if self.bias else [w, in_shape[-1]], [out], []

    def infer_type(self, in_type):
        return in_type, [np.float32], []

    def create_operator(self, ctx, shapes, dtypes):
        return _Operator(self.key)
