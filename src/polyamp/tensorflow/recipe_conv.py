"""Emulated low-precision convolutions in Keras 3: ``Conv1D`` / ``Conv2D`` / ``Conv3D`` as a recipe's three
quantized implicit GEMMs (``polyamp/recipes.py``, "Convolutions"):

    forward      y  = conv(Qf(x), Qf(W))            x along its channel axis, W along input channels (-2)
    input grad   dx = conv_input(Qb(g), Qf'(W))     g along its channel axis, W along output channels (-1)
    weight grad  dW = conv_weight(Qf'(x), Qb'(g))   x and g along the batch axis (0)

``W`` is Keras's kernel (spatial..., input channels / groups, filters), ``x`` and ``g`` lie in the
layer's ``data_format`` (channels on axis -1 or 1). ``conv`` is ``keras.ops.conv`` (``tf.nn.convolution``,
under XLA where TF's CPU kernels lack groups or 3-D channels_first); ``conv_input`` / ``conv_weight`` are
TF's gradients of that same op (``Conv*BackpropInput`` / ``Conv*BackpropFilter``), taken by a tape at the
quantized operands inside a ``tf.function`` per shape (``quantize.graph_call``), which prunes the forward
product the tape records. Products run in the recipe's compute dtype, ``dx`` comes out in ``x``'s dtype
and ``dW`` in the kernel's, as ``recipe.linear``'s.

A block-format operand is quantized with its blocked axis moved last (``tf.transpose``), blocks along that
axis, then moved back, so stochastic rounding indexes the moved tensor's elements in C order (``g``
blocked along the batch as (spatial..., channels, batch) for channels_last); an operand whose blocked
axis is already last is quantized as it lies. NVFP4's 16x16 weight blocks tile the kernel's last two axes
(input, output channels) at each kernel position and serve both GEMMs. Per-tensor formats quantize each
operand once, in its own layout, and ``g`` once for both backward GEMMs. With ``hadamard=True`` (NVFP4)
``x`` and ``g`` are first multiplied by the random Hadamard matrix in tiles of 16 along the batch axis
(zero padded): ``dW`` sums per-sample products, which an orthogonal ``H`` leaves unchanged but for the
quantization error. With ``groups > 1`` a block along the channels may span two groups (one scale for
both). ``Conv1D``'s causal padding pads ``x`` before the quantized GEMMs, as Keras's ``call`` does.
``Conv*Transpose``, ``DepthwiseConv*`` and ``SeparableConv*`` are left as Keras runs them.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from ..numerics.hadamard import hadamard_tiles
from ..recipe_gemms import CONV_BLOCKED, backward_operands, forward_operands
from .quantize import graph_call

CONV_LAYERS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def conv(quantizer, layer: str, compute, options: tuple):
    """``conv(x, w)`` with the recipe's three quantized GEMMs, their operands by ``recipe_gemms`` (the
    weight gradient quantizes ``x`` before ``g``); ``options`` = (strides, padding, dilation_rate,
    data_format), each hashable (``conv_options``)."""
    channel = -1 if options[3] == "channels_last" else 1
    axes = {"channels": channel, "in_channels": -2, "out_channels": -1, "batch": 0}

    def quantize(t, operand, gemm):
        return _blocked(quantizer, t, layer, operand, axes[CONV_BLOCKED[gemm, operand]])

    def c(t):
        return tf.cast(t, compute)

    @tf.custom_gradient
    def fn(x, w):
        xq, wq = forward_operands(quantizer.recipe, quantize, x, w)
        x_c, w_c = c(xq), c(wq)
        y = _conv(x_c, w_c, *options)

        def grad(g):
            (gq, w_op), (g_op, x_op) = backward_operands(
                quantizer.recipe, quantize, g, x, w, xq, wq, hadamard=_hadamard_batch,
                weight_grad_first="input")  # fmt: skip
            dx = tf.cast(graph_call(_input_grad, (c(gq), c(w_op), x_c), options), x.dtype)
            dw = graph_call(_weight_grad, (c(x_op), c(g_op), w_c), options)
            return dx, tf.cast(dw, w.dtype)

        return tf.cast(y, x.dtype), grad

    @tf.autograph.experimental.do_not_convert
    def apply(x, w):  # a variable read here, so the custom gradient sees only tensors
        return fn(tf.convert_to_tensor(x), tf.convert_to_tensor(w))

    return apply


def conv_options(layer) -> tuple:
    """The layer's (strides, padding, dilation_rate, data_format) for ``conv``: causal padding is done
    on the input (``conv_call``), so it convolves as ``valid``."""
    padding = "valid" if layer.padding == "causal" else layer.padding
    return tuple(layer.strides), padding, tuple(layer.dilation_rate), layer.data_format


def conv_call(layer, conv_fn):
    """Keras's ``BaseConv.call`` (and ``Conv1D``'s causal padding) with ``conv_fn`` for the convolution of
    the input with the float32 kernel (read outside Keras's autocast)."""

    def call(inputs, training=None):
        if layer.padding == "causal":
            inputs = keras.ops.pad(inputs, layer._compute_causal_padding())
        with keras.src.backend.AutocastScope(None):
            kernel = tf.convert_to_tensor(layer.kernel)
        outputs = conv_fn(inputs, kernel)
        if layer.use_bias:
            if layer.data_format == "channels_last":
                shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                shape = (1, layer.filters) + (1,) * layer.rank
            outputs = keras.ops.add(outputs, keras.ops.reshape(layer.bias, shape))
        if layer.activation is not None:
            return layer.activation(outputs)
        return outputs

    return call


def _blocked(quantizer, t, layer: str, operand: str, axis: int):
    """``t`` quantized by ``quantizer`` with blocks along ``axis``, moved last and back for a block format
    (NVFP4's 2-D weight blocks: the kernel's last two axes, as it lies)."""
    r = quantizer.recipe
    rank = t.shape.rank
    axis %= rank
    if r.kind != "block" or axis == rank - 1 or (r.weight_2d and operand == "weight"):
        return quantizer(t, layer, operand, -1)
    perm = [i for i in range(rank) if i != axis] + [axis]
    back = list(range(axis)) + [rank - 1] + list(range(axis, rank - 1))
    return tf.transpose(quantizer(tf.transpose(t, perm), layer, operand, -1), back)


def _hadamard_batch(t, _operand: str):
    return hadamard_tiles(t, 0)


def _conv(x, w, strides, padding, dilation, data_format):
    return keras.ops.conv(x, w, strides=list(strides), padding=padding, dilation_rate=list(dilation),
                          data_format=data_format)  # fmt: skip


def _input_grad(g, w, x, *options):
    """The convolution's gradient with respect to its input (``x`` gives the shape), ``g`` flowing back."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = _conv(x, w, *options)
    return tape.gradient(y, x, output_gradients=g)


def _weight_grad(x, g, w, *options):
    """The convolution's gradient with respect to its kernel (``w`` gives the shape)."""
    with tf.GradientTape() as tape:
        tape.watch(w)
        y = _conv(x, w, *options)
    return tape.gradient(y, w, output_gradients=g)
