"""A JAX recipe's operands, quantized: tensorwise (current or delayed scale) or in blocks, as JAX ops.

What the dense ``dot`` (``recipe.py``) and the convolution (``recipe_conv.py``) rules share: each GEMM
operand goes through ``quantize`` (the recipe's format, rounding and blocks for that operand), whose
values are ``polyamp.recipes.quantize_tensorwise`` / ``polyamp.quantize_blocks``' bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..errors import PolyampError
from ..numerics import blocks as _core_blocks
from ..numerics import get_format
from ..numerics.rounding import _MODE
from ..recipes import Recipe
from .blocks64 import blocks_keyed
from .quantize import _Grid, _key, _quantize
from .recipe_state import scale_from_amax

_FLOAT8 = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_F32 = jnp.float32


def current_scale(amax, fmt: str, margin: int = 0, eps: float = 0.0):
    """``polyamp.recipes.current_scale`` of a float32 amax, as JAX ops (no host read)."""
    return scale_from_amax(amax, fmt, margin, eps, 1.0)


def tensorwise(x, fmt: str, margin: int = 0, eps: float = 0.0, scale=None, rounding: str = "nearest",
               key=None):  # fmt: skip
    """``recipes.quantize_tensorwise(x, fmt, scale, rounding, seed)``, float32; ``scale`` defaults to
    ``current_scale(amax(x))``, ``key`` is the seed's stream key (``recipe_state.seed_key``)."""
    x32 = x.astype(_F32)
    if scale is None:
        scale = current_scale(amax_of(x32), fmt, margin, eps)
    y = x32 * scale
    if rounding == "nearest":
        fmax = float(get_format(fmt).max)
        q = jnp.clip(y, -fmax, fmax).astype(_FLOAT8[fmt]).astype(_F32)
    else:
        q = _quantize(y, key, _Grid.of(get_format(fmt), True).arrays(), mode=_MODE[rounding], dtype="float32")
    # XLA rewrites a division by a broadcast scalar as a product with its reciprocal (off by an ulp):
    # dividing by a materialised array keeps the correctly rounded quotient the core has
    return q / lax.optimization_barrier(jnp.broadcast_to(scale, q.shape))


def amax_of(x32):
    """max |x| of a float32 array (0 for an empty one)."""
    return jnp.max(jnp.abs(x32)) if x32.size else jnp.float32(0)


def quantize_operand(x, recipe: Recipe, operand: str, axis: int, scale=None, key=None,
                     transposed: bool = False):
    """``x`` quantized and dequantized as the recipe's ``operand`` ("input", "weight", "grad"), blocks
    along ``axis`` (NVFP4 weights: 16x16 tiles); float32. ``scale``: a delayed recipe's scale; ``key``:
    the stream key of stochastic rounding's seed (without it the recipe must round to nearest);
    ``transposed``: ``x`` (2-d) stands for ``x^T`` blocked along its last axis, so blocks run along
    ``x``'s axis 0 and stochastic rounding indexes ``x^T``'s elements (``quantize(x.T, ...).T``, without
    the transposed copies)."""
    grad = operand == "grad"
    fmt = recipe.backward_format if grad else recipe.forward_format
    rounding = recipe.grad_rounding if grad else recipe.forward_rounding
    if recipe.kind != "block" and transposed:
        return tensorwise(x.T, fmt, recipe.margin, recipe.amax_epsilon, scale, rounding, key).T
    if recipe.kind != "block":
        return tensorwise(x, fmt, recipe.margin, recipe.amax_epsilon, scale, rounding, key)
    block = (16, 16) if recipe.weight_2d and operand == "weight" else None
    axis = (-2, -1) if block else 0 if transposed else axis
    if key is None:
        rounding, key = "nearest", _key(0)
    bf, mode, _, rule = _core_blocks.arguments(fmt, recipe.scale_rule, rounding, 0)
    shape = _core_blocks._block_shape(bf, block)
    axes = _core_blocks._axes(axis, x.ndim, len(shape))
    return blocks_keyed(x.astype(_F32), key, bf, axes, shape, rule, mode, (1, 0) if transposed else None)


# structural ops through which a weight stays a weight (its cast, transpose or reshape)


def refuse_gradient(recipe: Recipe):
    """The error of a stateful recipe's gradient taken outside ``mp.value_and_grad``'s step."""
    raise PolyampError(
        f"the {recipe.name!r} recipe keeps state between steps (amax histories, a stochastic-"
        "rounding counter): take its gradients with mp.value_and_grad(f)(..., state=state) (or "
        "mp.grad), state = mp.init(), which threads that state through the step; outside it the "
        "autocast function only evaluates (current scaling, nearest rounding)"
    )
