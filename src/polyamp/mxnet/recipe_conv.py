"""Emulated low-precision training in MXNet Gluon for ``nn.Conv1D`` / ``Conv2D`` / ``Conv3D`` (channels-first
layouts, any ``groups``): the convolution's three implicit GEMMs quantized as ``polyamp.recipes`` defines
them (its module docstring, microxcaling's layout; which operand is quantized how: ``recipe_gemms.py``)::

    forward      y  = conv(Qf(x), Qf(W)) (+ b)      x along its channels (1), W along its input channels (1)
    input grad   dx = conv_input(Qb(g), Qf'(W))     g along its channels (1), W along its output channels (0)
    weight grad  dW = conv_weight(Qf'(x), Qb'(g))   x and g along the batch axis (0)

``Quantizer`` is ``recipe_operands.py``'s, so delayed-scaling histories and the stochastic-rounding counter
are shared with the Dense layers and kept per layer in ``mp.state_dict()``. Per-tensor recipes quantize each
operand once with one scale (``g`` once for both backward GEMMs), as ``QuantizedDense`` does. A
block-format operand is transposed so that its blocked axis is last, quantized along it, and transposed
back: stochastic rounding indexes the elements of that moved tensor in C order. NVFP4's weights are
quantized in 16x16 blocks over (output, input) channels at each kernel position (moved to the last two
axes), one quantized ``W`` for the forward and the input-gradient GEMM. With ``hadamard=True``, ``x`` and
``g`` are multiplied by the random Hadamard matrix in tiles of 16 along the batch axis (zero padded) before
quantization: ``dW = sum_n conv_weight(x_n, g_n)`` and ``H H^T = I``, so only the quantization error
changes.

The products are MXNet's own ``Convolution`` (not contrib.amp's) on operands cast to the compute dtype
(bfloat16 through oneDNN, which returns bf16, or float32); the two gradients are that operator's own
backward, run by a nested ``autograd.record()`` inside the Function's backward on float32 leaves cast to
the compute dtype within the record (MXNet 1.9 under contrib.amp refuses the backward of a bfloat16 leaf).
The Function's inputs are ``(weight, bias, x)`` with ``x`` in float32 and a block with frozen parameters
is left unquantized, for ``QuantizedDense``'s reasons (``recipe.py``); in a hybridized graph the block
emits ``recipe_graph.py``'s custom operator, which calls the same ``QuantizedConv``.
"""

from __future__ import annotations

import functools
import warnings

from ..numerics.hadamard import hadamard_tiles
from ..recipe_gemms import CONV_BLOCKED, FORWARD, backward_operands, forward_operands
from . import recipe_graph as graph
from .keep import _ORIGINAL_OPS, dtype_name
from .recipe_operands import Quantizer, cast, like, restore_forward

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import gluon

# MXNet's own Convolution: contrib.amp's would cast the operands to its dtype
_CONV = (_ORIGINAL_OPS or {}).get("mxnet.ndarray", {}).get("Convolution", mx.nd.Convolution)
CONV_BLOCKS = (gluon.nn.Conv1D, gluon.nn.Conv2D, gluon.nn.Conv3D)
LAYOUTS = ("NCW", "NCHW", "NCDHW")


def is_conv(block) -> bool:
    """Whether the recipe quantizes ``block`` as a convolution (not the transposed ones)."""
    return isinstance(block, CONV_BLOCKS)


def conv_unsupported(block) -> str | None:
    """Why the recipe cannot quantize this convolution (a layout that is not channels-first), or None."""
    layout = block._kwargs.get("layout")
    if layout not in LAYOUTS:
        return (f"layout {layout!r}; the recipe's quantized convolution takes the channels-first layouts "
                f"{', '.join(LAYOUTS)}")  # fmt: skip
    return None


def _conv(x, w, compute: str, kwargs: dict, bias=None):
    """MXNet's own Convolution in the compute dtype; an NDArray of that dtype."""
    args = (cast(x, compute), cast(w, compute)) + (() if bias is None else (cast(bias, compute),))
    return _CONV(*args, no_bias=bias is None, **kwargs)


def conv_shapes(kwargs: dict, x_shape) -> tuple[tuple[int, ...], ...]:
    """The weight, bias and output shapes of MXNet's Convolution with ``kwargs`` on an input of
    ``x_shape`` (its own shape inference)."""
    out = mx.sym.Convolution(mx.sym.var("x"), mx.sym.var("w"), mx.sym.var("b"), no_bias=False, **kwargs)
    args, outs, _ = out.infer_shape(x=tuple(x_shape))
    return tuple(args[1]), tuple(args[2]), tuple(outs[0])


def _conv_grads(x, w, head, compute: str, kwargs: dict, want_x: bool, want_w: bool):
    """(dx, dW) of ``conv(x, w)`` with output gradient ``head``: Convolution's own backward on float32 leaves
    cast to the compute dtype inside the record; float32 NDArrays (None for one not wanted)."""
    leaves = [t.detach() for t in (x, w)]
    for leaf, want in zip(leaves, (want_x, want_w)):
        if want:
            leaf.attach_grad()
    with mx.autograd.record():
        y = _conv(*leaves, compute, kwargs)
    y.backward(cast(head, compute))
    return tuple(like(t.grad, "float32") if want else None for t, want in zip(leaves, (want_x, want_w)))


def along(q: Quantizer, t, layer: str, operand: str, axis: int):
    """``t`` quantized as ``operand``: a block format blocked along ``axis`` (moved last, quantized, moved
    back); a per-tensor format as it is. Float32."""
    if q.recipe.kind != "block":
        return q(t, layer, operand)
    if axis % t.ndim == t.ndim - 1:
        return q(t, layer, operand, axis=-1)
    return mx.nd.moveaxis(q(mx.nd.moveaxis(t, axis, -1), layer, operand, axis=-1), -1, axis)


def weight_forward(q: Quantizer, w, layer: str):
    """``W`` (O, I/groups, k...) quantized for the forward GEMM: along its input channels, or NVFP4's 16x16
    blocks over (O, I) at each kernel position."""
    if not (q.recipe.kind == "block" and q.recipe.weight_2d):
        return along(q, w, layer, "weight", 1)
    nd = w.ndim
    moved = q(w.transpose(tuple(range(2, nd)) + (0, 1)), layer, "weight")  # (k..., O, I): 2-D blocks
    return moved.transpose((nd - 2, nd - 1) + tuple(range(nd - 2)))


class QuantizedConv(mx.autograd.Function):
    """Convolution with the recipe's three quantized GEMMs (module docstring)."""

    def __init__(self, quantizer: Quantizer, layer: str, compute: str, kwargs: dict):
        super().__init__()
        self.quantizer, self.layer, self.compute, self.kwargs = quantizer, layer, compute, kwargs

    def forward(self, weight, *rest):
        bias, x = rest if len(rest) == 2 else (None, rest[0])
        w32 = like(weight, "float32")  # to transpose (a bfloat16 transpose corrupts MXNet 1.9's heap)
        xq, wq = forward_operands(self.quantizer.recipe, _conv_operand(self.quantizer, self.layer), x, w32)
        self.save_for_backward(x, w32, xq, wq)
        self.dtypes = (dtype_name(x.dtype), dtype_name(weight.dtype), bias is not None)
        return _conv(xq, wq, self.compute, self.kwargs, bias)

    def backward(self, grad):
        x, w32, xq, wq = self.saved_tensors
        x_dtype, w_dtype, has_bias = self.dtypes
        grad, x = like(grad, "float32"), like(x, "float32")
        quantize = _conv_operand(self.quantizer, self.layer)
        dgrad, wgrad = backward_operands(self.quantizer.recipe, quantize, grad, x, w32, xq, wq,
                                         hadamard=_hadamard_batch)  # fmt: skip
        (g_dx, w_dx), (g_dw, x_dw) = dgrad, wgrad
        args = self.compute, self.kwargs
        if g_dx is g_dw:  # one head gradient: one backward
            dx, dw = _conv_grads(x_dw, w_dx, g_dx, *args, True, True)
        else:
            dx, _ = _conv_grads(x, w_dx, g_dx, *args, True, False)
            _, dw = _conv_grads(x_dw, w32, g_dw, *args, False, True)
        out = [like(dw, w_dtype)]
        if has_bias:
            out.append(like(mx.nd.sum(grad, axis=1, exclude=True), w_dtype))
        return (*out, like(dx, x_dtype))


_AXES = {"channels": 1, "in_channels": 1, "out_channels": 0, "batch": 0}  # of x, g (N, C, ...); W (O, I, ...)


def _conv_operand(q: Quantizer, layer: str):
    """``recipe_gemms``' quantize for Convolution's layouts: ``along`` ``CONV_BLOCKED``'s axis; the
    forward's ``W`` by ``weight_forward`` (NVFP4's 16x16 blocks)."""

    def quantize(t, operand: str, gemm: str):
        if operand == "weight" and gemm == FORWARD:
            return weight_forward(q, t, layer)
        return along(q, t, layer, operand, _AXES[CONV_BLOCKED[gemm, operand]])

    return quantize


def _hadamard_batch(t, _operand: str):
    """NVFP4's RHT of the weight gradient's ``x`` or ``g``: tiles of 16 along the batch, zero padded."""
    return hadamard_tiles(t, 0)


class RecipeConv:
    """One watched convolution block: its ``hybrid_forward`` replaced (an instance attribute) by the
    quantized GEMMs, with the block's own Convolution arguments; ``remove()`` puts the previous one back."""

    def __init__(self, name: str, block, quantizer: Quantizer, compute: str):
        self.name, self.block, self._restore = name, block, restore_forward
        self._own = vars(block).get("hybrid_forward")
        original = getattr(self._own, "recipe_of", None)  # another recipe's forward: replace it
        if original is not None:
            self._own = original
        kwargs = {k: v for k, v in block._kwargs.items() if k != "no_bias"}

        make = functools.partial(QuantizedConv, quantizer, name, compute, kwargs)
        self.key = graph.register(graph.Layer(make, functools.partial(conv_shapes, kwargs), compute))

        def hybrid_forward(F, x, weight, bias=None):
            if F is not mx.nd:  # traced into a hybridized graph: the custom operator
                y = graph.custom(F, self.key, weight, bias, x)
                return y if block.act is None else block.act(y)
            x32 = like(x, "float32")  # a float32 gradient buffer (MXNet copies a bf16 one wrongly under amp)
            y = QuantizedConv(quantizer, name, compute, kwargs)(
                *((weight, x32) if bias is None else (weight, bias, x32))
            )
            return y if block.act is None else block.act(y)

        hybrid_forward.recipe_of = self._own
        vars(block)["hybrid_forward"] = hybrid_forward

    def remove(self) -> None:
        graph.unregister(self.key)
        if getattr(vars(self.block).get("hybrid_forward"), "recipe_of", False) is self._own:
            self._restore(self.block, self._own)
