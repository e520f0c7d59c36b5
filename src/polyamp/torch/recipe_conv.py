"""Emulated low-precision convolutions in PyTorch: ``F.conv1d`` / ``conv2d`` / ``conv3d`` as a recipe's
three quantized implicit GEMMs (``polyamp/recipes.py``, "Convolutions"):

    forward      y  = conv(Qf(x), Qf(W)) (+ b)          x along channels (1), W along input channels (1)
    input grad   dx = conv_input(Qb(g), Qf'(W))         g along channels (1), W along output channels (0)
    weight grad  dW = conv_weight(Qf'(x), Qb'(g))       x and g along the batch axis (0)

``conv_input`` / ``conv_weight`` are ``torch.nn.grad``'s ``convNd_input`` / ``convNd_weight``, the
convolution's own gradients, evaluated at the quantized operands in the recipe's compute dtype. A
block-format operand is quantized with its blocked axis moved last (``movedim``; NVFP4's 16x16 weight
blocks: the (output, input) channel axes moved last), so stochastic rounding indexes that tensor's
elements; per-tensor formats quantize each operand once, in its own layout, and the output gradient once
for both backward GEMMs. With ``hadamard=True`` (NVFP4) ``x`` and ``g`` are first multiplied by the
random Hadamard matrix in tiles of 16 along the batch axis (zero padded): ``dW`` is a sum over the batch
of per-sample products, which an orthogonal ``H`` leaves unchanged but for the quantization error.
``padding="same"`` with an even total padding is symmetric; an odd one pads ``x`` explicitly first
(torch's split: the extra element on the right). Transposed convolutions are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..numerics.hadamard import hadamard_tiles
from ..recipe_gemms import CONV_BLOCKED, backward_operands, forward_operands

_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_grad = torch.nn.grad
_INPUT_GRAD = {1: _grad.conv1d_input, 2: _grad.conv2d_input, 3: _grad.conv3d_input}
_WEIGHT_GRAD = {1: _grad.conv1d_weight, 2: _grad.conv2d_weight, 3: _grad.conv3d_weight}
_PARAMETERS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def is_conv(func) -> bool:
    return func in _FUNCTIONS


def quantized_conv(func, args, kwargs, quantizer, layer: str, compute: torch.dtype) -> torch.Tensor:
    """``func(*args, **kwargs)`` (an ``F.convNd`` call) through ``_QuantizedConv``: arguments named,
    integers widened to tuples, string padding resolved, an unbatched input given a batch of 1."""
    named = dict(zip(_PARAMETERS, args), **kwargs)
    nd = _FUNCTIONS[func]
    x, w = named["input"], named["weight"]
    stride, dilation = _tuple(named.get("stride", 1), nd), _tuple(named.get("dilation", 1), nd)
    padding = named.get("padding", 0)
    if isinstance(padding, str):
        x, padding = _resolve_padding(x, w, padding, dilation)
    unbatched = x.dim() == nd + 1
    x = x.unsqueeze(0) if unbatched else x
    y = _QuantizedConv.apply(x, w, named.get("bias"), (stride, _tuple(padding, nd), dilation,
                             named.get("groups", 1)), quantizer, layer, compute)  # fmt: skip
    return y.squeeze(0) if unbatched else y


def _tuple(v, nd: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * nd


def _resolve_padding(x: torch.Tensor, w: torch.Tensor, padding: str, dilation: tuple[int, ...]):
    """``"valid"`` is no padding; ``"same"`` pads ``d (k - 1)`` in all per axis, half on each side, an odd
    one element more on the right (explicitly, as ``F.pad`` of ``x``)."""
    nd = len(dilation)
    if padding == "valid":
        return x, (0,) * nd
    totals = [d * (k - 1) for d, k in zip(dilation, w.shape[2:])]
    if all(t % 2 == 0 for t in totals):
        return x, tuple(t // 2 for t in totals)
    pad = []
    for t in reversed(totals):  # F.pad lists the last axis first
        pad += [t // 2, t - t // 2]
    return F.pad(x, pad), (0,) * nd


def _blocked(quantizer, t: torch.Tensor, layer: str, operand: str, axis: int, dtype: torch.dtype):
    """``t`` quantized by ``quantizer`` with blocks along ``axis`` (moved last, then back; NVFP4's 2-D
    weight blocks: axes 0 and 1), then cast to ``dtype``; a per-tensor recipe quantizes ``t`` as it lies."""
    r = quantizer.recipe
    if r.kind != "block":
        return quantizer(t, layer, operand).to(dtype)
    axes = (0, 1) if r.weight_2d and operand == "weight" else (axis,)
    if axes == (0,):  # t moved to (..., n) is t as [n, rest] transposed: blocked in place, not copied
        q = quantizer(t.reshape(t.shape[0], -1).t(), layer, operand, axis=-1).t().reshape(t.shape)
    else:
        last = tuple(range(-len(axes), 0))
        q = quantizer(t.movedim(axes, last).contiguous(), layer, operand, axis=-1).movedim(last, axes)
    # in t's memory layout (the convolution's kernel, and its rounding, depends on the layout) and cast
    # in the same pass: the float32 result rounded once more, as a cast of it would be
    return torch.empty_like(t, dtype=dtype).copy_(q)


class _QuantizedConv(torch.autograd.Function):
    """``F.convNd`` with the recipe's three quantized implicit GEMMs (module docstring), their operands
    by ``recipe_gemms``; the backward skips a gradient that autograd does not need."""

    @staticmethod
    def forward(ctx, x, weight, bias, geometry, quantizer, layer: str, compute: torch.dtype):
        stride, padding, dilation, groups = geometry
        xq, wq = forward_operands(quantizer.recipe, _conv_operand(quantizer, layer, compute), x, weight)
        ctx.save_for_backward(x, weight, xq, wq)
        ctx.args = (geometry, quantizer, layer, compute, bias is not None, x.dtype, weight.dtype)
        b = None if bias is None else bias.to(compute)
        conv = (F.conv1d, F.conv2d, F.conv3d)[x.dim() - 3]
        return conv(xq.to(compute), wq.to(compute), b, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad):
        x, weight, xq, wq = ctx.saved_tensors
        geometry, quantizer, layer, compute, has_bias, x_dtype, w_dtype = ctx.args
        nd = x.dim() - 2
        dgrad, wgrad = backward_operands(
            quantizer.recipe, _conv_operand(quantizer, layer, compute), grad, x, weight, xq, wq,
            hadamard=_hadamard_batch, want=ctx.needs_input_grad[:2])  # fmt: skip
        dx = dw = db = None
        if dgrad is not None:
            g_op, w_op = dgrad
            dx = _INPUT_GRAD[nd](x.shape, w_op.to(compute), g_op.to(compute), *geometry).to(x_dtype)
        if wgrad is not None:
            g_op, x_op = wgrad
            dw = _WEIGHT_GRAD[nd](x_op.to(compute), weight.shape, g_op.to(compute), *geometry).to(w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            db = grad.float().sum([0, *range(2, grad.dim())]).to(w_dtype)
        return dx, dw, db, None, None, None, None


_AXES = {"channels": 1, "in_channels": 1, "out_channels": 0, "batch": 0}  # of x, g [N, C, ...]; W [O, I, ...]


def _conv_operand(quantizer, layer: str, compute: torch.dtype):
    """``recipe_gemms``' quantize for ``F.convNd``'s layouts: ``_blocked`` along ``CONV_BLOCKED``'s axis."""

    def quantize(t: torch.Tensor, operand: str, gemm: str) -> torch.Tensor:
        return _blocked(quantizer, t, layer, operand, _AXES[CONV_BLOCKED[gemm, operand]], compute)

    return quantize


def _hadamard_batch(t: torch.Tensor, _operand: str) -> torch.Tensor:
    return hadamard_tiles(t, 0)
