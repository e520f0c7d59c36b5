"""Emulated low-precision training in JAX: ``polyamp.recipes`` on the dense matmuls of an autocast function.

``mp.autocast(fn)`` of a ``MixedPrecision`` made from a recipe runs ``fn`` through the autocast
interpreter (``autocast.py``), which hands each dense matmul ``x @ w`` — a ``dot_general`` contracting
the last axis of ``x`` with the first of a 2-d ``w``, no batch dimensions (``jnp.matmul`` / ``jnp.dot``
of activations and a weight matrix, as dense layers write it) — to :func:`dot`: the three GEMMs of
the recipe, as ``polyamp/torch/recipe.py`` describes, in a ``jax.custom_vjp``:

    forward        y  = Qf(x) @ Qf(w)           blocks along K (x's last axis, w's first)
    input grad     dx = Qb(g) @ Qf'(w)^T        blocks along N (g's last axis, w's last)
    weight grad    dw = Qf'(x)^T @ Qb'(g)       blocks along the rows M of x and g

Batched matmuls (attention's scores and values) and convolutions run as the bf16 policy does. A
layer is its ``jax.named_scope`` path; the keep list's ``first`` / ``last`` are the scope paths of the
first and last dense matmul in trace order, other entries ``fnmatch`` patterns over the paths.

Quantization is JAX ops, bit-identical to the numpy core (``tests/test_jax_recipes.py``): per-tensor
scales are TE's float32 quotient ``Fmax / amax`` (``recipes.current_scale``; the quotient of two
float32 is rounded once, as the core's float64-then-float32 is), the casts ``jnp.float8_e4m3fn`` /
``float8_e5m2`` after clamping to the format's range; blocks are ``polyamp.jax.quantize_blocks``. One
exception: XLA on the CPU flushes float32 subnormals, so a tensor whose every value is subnormal (its
amax below 2^-126) quantizes to zeros, where the core scales it up.
Not here yet: delayed scaling (its amax history changes each step, which a jitted function would have
to take and return) and stochastic rounding (it needs a new random stream each step).
"""

from __future__ import annotations

import fnmatch

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import PolyampError
from ..numerics import get_format
from ..recipes import Recipe
from .quantize import quantize_blocks
from .scopes import name_scopes

_FLOAT8 = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
_FLT_MAX = float(np.finfo(np.float32).max)
_F32 = jnp.float32


def current_scale(amax, fmt: str, margin: int = 0, eps: float = 0.0):
    """``polyamp.recipes.current_scale`` of a float32 amax, as JAX ops (no host read)."""
    scaled_max = np.float32(float(get_format(fmt).max) * 2.0**-margin)
    a = jnp.where(amax < eps, jnp.float32(eps), amax)
    q = scaled_max / a  # XLA on the CPU reads a subnormal amax as 0: inf, float32's max below as in the core
    q = jnp.where(jnp.isinf(q), jnp.float32(_FLT_MAX), q)
    positive = lax.bitcast_convert_type(a, jnp.int32) > 0  # a subnormal amax is > 0 for the core too
    return jnp.where(jnp.isfinite(a) & positive, q, jnp.float32(1.0))


def tensorwise(x, fmt: str, margin: int = 0, eps: float = 0.0):
    """``recipes.quantize_tensorwise(x, fmt, current_scale(amax(x)))``, float32."""
    x32 = x.astype(_F32)
    scale = current_scale(jnp.max(jnp.abs(x32)) if x32.size else jnp.float32(0), fmt, margin, eps)
    fmax = float(get_format(fmt).max)
    q = jnp.clip(x32 * scale, -fmax, fmax).astype(_FLOAT8[fmt]).astype(_F32)
    # XLA rewrites a division by a broadcast scalar as a product with its reciprocal (off by an ulp):
    # dividing by a materialised array keeps the correctly rounded quotient the core has
    return q / lax.optimization_barrier(jnp.broadcast_to(scale, q.shape))


def quantize(x, recipe: Recipe, operand: str, axis: int):
    """``x`` quantized and dequantized as the recipe's ``operand`` ("input", "weight", "grad"), blocks
    along ``axis`` (NVFP4 weights: 16x16 tiles); float32."""
    fmt = recipe.backward_format if operand == "grad" else recipe.forward_format
    if recipe.kind != "block":
        return tensorwise(x, fmt, recipe.margin, recipe.amax_epsilon)
    if recipe.weight_2d and operand == "weight":
        return quantize_blocks(x.astype(_F32), fmt, axis=(-2, -1), block=(16, 16))
    return quantize_blocks(x.astype(_F32), fmt, axis=axis, scale_rule=recipe.scale_rule)


def eligible(eqn) -> bool:
    """A dense matmul (module docstring) of floating operands narrower than float64."""
    if eqn.primitive.name != "dot_general":
        return False
    lhs, rhs = (v.aval for v in eqn.invars)
    (contract, batch) = eqn.params["dimension_numbers"]
    floating = all(jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float64 for a in (lhs, rhs))
    dense = tuple(map(tuple, contract)) == ((lhs.ndim - 1,), (0,)) and tuple(map(tuple, batch)) == ((), ())
    return floating and dense and rhs.ndim == 2 and lhs.ndim >= 1


def quantized(interpreter, eqn, invals, scope) -> list | None:
    """The outputs of ``eqn`` run as the interpreter's recipe says, or None where it leaves ``eqn`` to the
    policy: no recipe, not a dense matmul, a kept scope, or a transpose a custom VJP traces (no scope)."""
    r = interpreter.recipe
    if r is None or scope is None or not eligible(eqn) or "/".join(scope) in interpreter.recipe_kept:
        return None
    return [dot(r, interpreter.compute, interpreter.output, _F32)(*invals)]


def dot(recipe: Recipe, compute, output, preferred):
    """``x @ w`` with the recipe's three quantized GEMMs (module docstring), products in ``compute``
    accumulated in ``preferred`` (float32), the result in ``output``."""
    fq, bq, wq_ = recipe.quantize_forward, recipe.quantize_input_grad, recipe.quantize_weight_grad
    block = recipe.kind == "block"

    def matmul(a, b):  # a [..., K] @ b [K, N]
        dims = (((a.ndim - 1,), (0,)), ((), ()))
        return lax.dot_general(a.astype(compute), b.astype(compute), dims, preferred_element_type=preferred)

    def forward(x, w):
        xq = quantize(x, recipe, "input", -1) if fq else x
        wq = quantize(w, recipe, "weight", 0) if fq else w
        return matmul(xq, wq).astype(output), (x, w, xq, wq)

    def backward(res, g):
        x, w, xq, wq = res
        n, k = w.shape[1], w.shape[0]
        g2, x2 = g.reshape(-1, n), x.reshape(-1, k)
        once = quantize(g2, recipe, "grad", -1) if (bq or wq_) and not block else None
        gq, w_op = g2, w
        if bq:
            gq = quantize(g2, recipe, "grad", -1) if block else once
            w_op = quantize(w, recipe, "weight", 1) if block and not recipe.weight_2d else wq
        dx = matmul(gq, w_op.T).reshape(x.shape).astype(x.dtype)
        x_op, g_op = x2, g2
        if wq_:
            x_op = quantize(x2, recipe, "input", 0) if block else xq.reshape(-1, k)
            g_op = quantize(g2, recipe, "grad", 0) if block else once
        dw = matmul(x_op.T, g_op).astype(w.dtype)
        return dx, dw

    fn = jax.custom_vjp(lambda x, w: forward(x, w)[0])
    fn.defvjp(forward, backward)
    return fn


def kept_layers(jaxpr, keep: tuple[str, ...]) -> set[str]:
    """The scope paths (joined by "/") whose dense matmuls the keep list keeps; PolyampError for a
    pattern that matches none."""
    paths = list(dict.fromkeys(_dense_paths(jaxpr, ())))
    kept: set[str] = set()
    for entry in keep:
        if entry in ("first", "last"):
            if paths:
                kept.add(paths[0] if entry == "first" else paths[-1])
            continue
        found = [p for p in paths if fnmatch.fnmatchcase(p, entry)]
        if not found:
            raise PolyampError(f"the recipe's keep entry {entry!r} matches no dense matmul's scope; "
                               f"their scopes: {', '.join(map(repr, paths[:20])) or 'none'}")  # fmt: skip
        kept.update(found)
    return kept


def _dense_paths(jaxpr, scope: tuple[str, ...]):
    """The scope path of each dense matmul, in trace order, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        path = scope + name_scopes(eqn)
        if eligible(eqn):
            yield "/".join(path)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dense_paths(inner, path)
