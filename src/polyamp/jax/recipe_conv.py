"""Emulated low-precision training of JAX convolutions: ``conv_general_dilated`` as a recipe's three GEMMs.

A convolution is the implicit GEMM ``K`` = input channels per group times kernel positions, and each
operand is blocked along a dimension its GEMM sums over (``polyamp/recipes.py``; microxcaling's
``mx/convolution.py``), with the dimension numbers' ``lhs_spec`` / ``rhs_spec`` / ``out_spec``:

    forward      y  = conv(Qf(x), Qf(W))           x along lhs_spec[1] (channels), W along rhs_spec[1]
    input grad   dx = conv_x^T(Qb(g); Qf'(W))      g along out_spec[1] (channels), W along rhs_spec[0]
    weight grad  dW = conv_W^T(Qb'(g); Qf'(x))     x along lhs_spec[0], g along out_spec[0] (batch)

``conv_x^T`` / ``conv_W^T`` are the transposes of the convolution in ``x`` and in ``W``
(``jax.linear_transpose``, the convolutions JAX's own VJP runs). Blocks may straddle feature groups,
as microxcaling's do. NVFP4's 16x16 weight blocks tile ``(rhs_spec[0], rhs_spec[1])`` (output, input
channels) at each kernel position and serve the forward and input-gradient GEMMs; with
``hadamard=True`` ``x`` and ``g`` are first multiplied by the random Hadamard matrix in tiles of 16
along the batch axis (:func:`polyamp.numerics.hadamard_tiles`, zero padded): ``dW = sum_n
conv_W^T(g_n; x_n)`` and ``H^T H = I``, so only the quantization error changes. Per-tensor recipes
quantize ``x``, ``W`` and ``g`` once each, as for a dense matmul.

Layout: a block operand is quantized as if its blocked axis (NVFP4 weights: the pair (output, input))
were moved last, so stochastic rounding indexes the elements of that moved tensor in C order; the move
is never made (``blocks_keyed``'s ``order``). A per-tensor operand is indexed in its own layout.
Products are in ``compute``, accumulated in ``preferred`` (float32), in all three convolutions.

A convolution makes the quantize calls of a dense matmul, in the same order (``recipe_state``'s
``calls_per_matmul``: ``x, W`` forward; ``g``, ``W`` (unless 16x16), ``g``, ``x`` backward; per-tensor
recipes ``x, W`` then ``g``), so it takes its place in a step's seed sequence as one more matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from ..numerics import blocks as _core_blocks
from ..numerics.hadamard import hadamard_tiles
from ..recipe_gemms import CONV_BLOCKED, backward_operands, forward_operands
from ..recipes import Recipe
from .blocks64 import blocks_keyed
from .quantize import _key
from .recipe_operands import amax_of, refuse_gradient, tensorwise
from .recipe_state import Run, calls_per_matmul, seed_key

_F32 = jnp.float32


def quantize_along(x, recipe: Recipe, operand: str, axes: tuple[int, ...], scale=None, key=None):
    """``x`` quantized and dequantized as the recipe's ``operand`` ("input", "weight", "grad"), float32:
    blocks along ``axes`` (one axis; NVFP4 16x16 weights: the pair (output, input)), indexed as
    ``jnp.moveaxis(x, axes, last)`` for stochastic rounding; per-tensor formats with one scale
    (``scale``: a delayed recipe's). ``key``: stochastic rounding's stream key (None: nearest)."""
    grad = operand == "grad"
    fmt = recipe.backward_format if grad else recipe.forward_format
    rounding = recipe.grad_rounding if grad else recipe.forward_rounding
    if recipe.kind != "block":
        return tensorwise(x, fmt, recipe.margin, recipe.amax_epsilon, scale, rounding, key)
    if key is None:
        rounding, key = "nearest", _key(0)
    bf, mode, _, rule = _core_blocks.arguments(fmt, recipe.scale_rule, rounding, 0)
    axes = tuple(a % x.ndim for a in axes)
    shape = _core_blocks._block_shape(bf, (16, 16) if len(axes) == 2 else None)
    order = (*(d for d in range(x.ndim) if d not in axes), *axes)
    order = None if order == tuple(range(x.ndim)) else order
    return blocks_keyed(x.astype(_F32), key, bf, axes, shape, rule, mode, order)


def conv(recipe: Recipe, compute, output, preferred, params, run: Run | None = None, index: int = 0,
         trainable: bool = True):  # fmt: skip
    """``conv_general_dilated(x, W, **params)`` with the recipe's three quantized GEMMs (module
    docstring), products in ``compute`` accumulated in ``preferred``, the result in ``output``;
    ``trainable=False``: its gradient raises (a stateful recipe outside its step).

    With ``run`` the function takes ``(x, W, scale_x, scale_w, scale_g, calls)`` and returns the amaxes
    of ``x``, ``W`` and ``g`` as the scales' cotangents, as ``recipe.dot`` does."""
    delayed = recipe.kind == "delayed"
    numbers = params["dimension_numbers"]
    lhs, rhs, out = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
    axes = {  # recipe_gemms.CONV_BLOCKED's dimensions of each operand, by the dimension numbers
        "input": {"channels": (lhs[1],), "batch": (lhs[0],)},
        "grad": {"channels": (out[1],), "batch": (out[0],)},
        "weight": {"in_channels": (rhs[0], rhs[1]) if recipe.weight_2d else (rhs[1],),
                   "out_channels": (rhs[0],)},
    }  # fmt: skip

    def convolve(a, b, accumulate=compute):
        return lax.conv_general_dilated_p.bind(a, b, **{**params, "preferred_element_type": accumulate})

    def transposed(linear, like, ct):  # linear's transpose at ct, accumulated in preferred
        return _transposed(linear, jax.ShapeDtypeStruct(like.shape, compute), ct.astype(compute), preferred)

    def keys(calls, backward, count):
        if run is None:
            return [None] * count
        return [seed_key(calls, run.seed_position(index, i, backward)) for i in range(count)]

    def quantizer(keys, scales):
        """``recipe_gemms``' quantize, each call with the next of ``keys``."""
        keys = iter(keys)

        def quantize(t, operand, gemm):
            scale = scales[operand] if delayed else None
            return quantize_along(t, recipe, operand, axes[operand][CONV_BLOCKED[gemm, operand]], scale,
                                  next(keys))  # fmt: skip

        return quantize

    def hadamard(t, operand):  # tiles of 16 along the batch axis
        return hadamard_tiles(t, axes[operand]["batch"][0])

    def forward(x, w, sx=None, sw=None, sg=None, calls=None):
        quantize = quantizer(keys(calls, False, 2), {"input": sx, "weight": sw})
        xq, wq = forward_operands(recipe, quantize, x, w)
        amaxes = (amax_of(x.astype(_F32)), amax_of(w.astype(_F32))) if delayed else ()
        y = convolve(xq.astype(compute), wq.astype(compute), preferred)
        return y.astype(output), (x, w, xq, wq, sg, calls, amaxes)

    def backward(res, g):
        if not trainable:
            refuse_gradient(recipe)
        x, w, xq, wq, sg, calls, amaxes = res
        quantize = quantizer(keys(calls, True, calls_per_matmul(recipe)[1]), {"grad": sg})
        (gq, w_op), (g_op, x_op) = backward_operands(recipe, quantize, g, x, w, xq, wq, hadamard=hadamard)
        w_c = w_op.astype(compute)
        dx = transposed(lambda a: convolve(a, w_c), x, gq)
        x_c = x_op.astype(compute)
        dw = transposed(lambda b: convolve(x_c, b), w, g_op)
        dx, dw = dx.astype(x.dtype), dw.astype(w.dtype)
        if run is None:
            return dx, dw
        d_scales = (*amaxes, amax_of(g.astype(_F32))) if delayed else (jnp.float32(0),) * 3
        return (dx, dw, *d_scales, None)

    fn = jax.custom_vjp(lambda *args: forward(*args)[0])
    fn.defvjp(forward, backward)
    return fn


def _transposed(linear, primal, ct, preferred):
    """The transpose of the convolution ``linear`` of compute-dtype operands (``primal``: its argument's
    shape and dtype) at the cotangent ``ct`` (that dtype), its convolutions rebound to accumulate in
    ``preferred``: ``jax.linear_transpose`` alone would round the result to the compute dtype (or, given
    a float32 cotangent, widen the other operand and multiply in float32)."""
    closed = jax.make_jaxpr(jax.linear_transpose(linear, primal))(ct)
    env = dict(zip(closed.jaxpr.constvars, closed.consts))
    env.update(zip(closed.jaxpr.invars, [ct]))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in closed.jaxpr.eqns:
        params = eqn.params
        if eqn.primitive.name == "conv_general_dilated":
            params = {**params, "preferred_element_type": preferred}
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    (result,) = map(read, closed.jaxpr.outvars)
    return result
