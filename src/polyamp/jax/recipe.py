"""Emulated low-precision training in JAX: ``polyamp.recipes`` on the dense matmuls and convolutions of
an autocast function.

``mp.autocast(fn)`` of a ``MixedPrecision`` made from a recipe runs ``fn`` through the autocast
interpreter (``autocast.py``), which hands each dense matmul ``x @ w`` — a ``dot_general`` contracting
the last axis of ``x`` with the first of a 2-d ``w``, no batch dimensions (``jnp.matmul`` / ``jnp.dot``
of activations and a weight matrix, as dense layers write it) — to :func:`dot`: the three GEMMs of
the recipe, as ``polyamp/torch/recipe.py`` describes, in a ``jax.custom_vjp``:

    forward        y  = Qf(x) @ Qf(w)           blocks along K (x's last axis, w's first)
    input grad     dx = Qb(g) @ Qf'(w)^T        blocks along N (g's last axis, w's last)
    weight grad    dw = Qf'(x)^T @ Qb'(g)       blocks along the rows M of x and g

Each operand is quantized as torch's layout has it (``w^T`` for the forward weight, ``x^T`` and ``g^T``
for the weight gradient, blocked along their last axis), so stochastic rounding indexes the same
elements as torch's recipe; the transposed operands are never copied: ``w``, ``x`` and ``g`` are blocked
along their axis 0 in place, indexed as their transposes (``quantize(..., transposed=True)``). With
``hadamard=True`` (NVFP4) ``x^T`` and ``g^T`` are first multiplied by the random Hadamard matrix in
tiles of 16 along ``M`` (:func:`hadamard_tiles`, ``polyamp/numerics/hadamard.py``'s
float32 butterfly; ``M`` zero padded to a multiple of 16).

Convolutions (``conv_general_dilated`` without batch groups) run as the implicit GEMMs they are, by
``recipe_conv.py``'s :func:`~polyamp.jax.recipe_conv.conv`; batched matmuls (attention's scores and
values) run as the bf16 policy does. A layer is its ``jax.named_scope`` path; the keep list's ``first``
/ ``last`` are the scope paths of the first and last quantizable layer, dense matmul or convolution, in
trace order, other entries ``fnmatch`` patterns over the paths.

Quantization is JAX ops, bit-identical to the numpy core (``tests/test_jax_recipes.py``): per-tensor
scales are TE's float32 quotient ``Fmax / amax`` (``recipes.current_scale``; the quotient of two
float32 is rounded once, as the core's float64-then-float32 is), the casts ``jnp.float8_e4m3fn`` /
``float8_e5m2`` after clamping to the format's range; blocks are ``polyamp.jax.quantize_blocks``'s. One
exception: XLA on the CPU flushes float32 subnormals, so a tensor whose every value is subnormal (its
amax below 2^-126) quantizes to zeros, where the core scales it up, and a Hadamard tile whose inputs,
sums or results are subnormal differs from the core's there.

Recipes that keep state between steps, delayed scaling and stochastic rounding, take it from the step
``mp.value_and_grad`` runs: the delayed scales, the seeds ``calls + position`` (torch's ``Quantizer``
sequence), and the amaxes handed back as the scales' cotangents (``recipe_state.py``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import PolyampError
from ..numerics import blocks as _core_blocks
from ..numerics import get_format
from ..numerics import hadamard as _hadamard
from ..numerics.rounding import _MODE
from ..recipes import Recipe
from .quantize import _Grid, _key, _quantize, blocks_keyed
from .recipe_state import OPERANDS, Run, active, calls_per_matmul, keeps_state, scale_from_amax, seed_key
from .scopes import name_scopes

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
        scale = current_scale(_amax(x32), fmt, margin, eps)
    y = x32 * scale
    if rounding == "nearest":
        fmax = float(get_format(fmt).max)
        q = jnp.clip(y, -fmax, fmax).astype(_FLOAT8[fmt]).astype(_F32)
    else:
        q = _quantize(y, key, _Grid.of(get_format(fmt), True).arrays(), mode=_MODE[rounding], dtype="float32")
    # XLA rewrites a division by a broadcast scalar as a product with its reciprocal (off by an ulp):
    # dividing by a materialised array keeps the correctly rounded quotient the core has
    return q / lax.optimization_barrier(jnp.broadcast_to(scale, q.shape))


def _amax(x32):
    return jnp.max(jnp.abs(x32)) if x32.size else jnp.float32(0)


def quantize(x, recipe: Recipe, operand: str, axis: int, scale=None, key=None, transposed: bool = False):
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


def hadamard_tiles(x, axis: int = -1):
    """``polyamp.numerics.hadamard_tiles`` as JAX ops: ``x`` (float32) zero padded along ``axis`` to a
    multiple of 16, each tile times ``SIGNS``, the four butterfly stages ``h = 1, 2, 4, 8`` in float32,
    then ``* 0.25``; the same elementwise float32 operations in the same order, so the same bits. The
    tiles are split in place (no axis moves: a transposed copy of a large operand costs more than the
    butterfly)."""
    v = x.astype(_F32)
    axis = axis % v.ndim
    n, lead, rest = v.shape[axis], v.shape[:axis], v.shape[axis + 1 :]
    v = jnp.pad(v, [(0, 0)] * axis + [(0, -n % _hadamard.TILE)] + [(0, 0)] * len(rest))
    tiles = v.shape[axis] // _hadamard.TILE
    t = v.reshape(*lead, tiles, _hadamard.TILE, *rest) * _hadamard.SIGNS.reshape(-1, *[1] * len(rest))
    for h in _hadamard.STAGES:
        pairs = t.reshape(*lead, tiles, _hadamard.TILE // (2 * h), 2, h, *rest)
        a, b = (lax.index_in_dim(pairs, i, axis + 2, keepdims=False) for i in (0, 1))
        t = jnp.stack([a + b, a - b], axis=axis + 2)
    return (t * np.float32(0.25)).reshape(v.shape)


def eligible(eqn) -> bool:
    """A dense matmul (module docstring) or a convolution with ``batch_group_count == 1`` (any feature
    groups), of floating operands narrower than float64."""
    name = eqn.primitive.name
    if name not in ("dot_general", "conv_general_dilated"):
        return False
    lhs, rhs = (v.aval for v in eqn.invars)
    floating = all(jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float64 for a in (lhs, rhs))
    if name == "conv_general_dilated":
        return floating and eqn.params["batch_group_count"] == 1
    (contract, batch) = eqn.params["dimension_numbers"]
    dense = tuple(map(tuple, contract)) == ((lhs.ndim - 1,), (0,)) and tuple(map(tuple, batch)) == ((), ())
    return floating and dense and rhs.ndim == 2 and lhs.ndim >= 1


def quantized(interpreter, eqn, invals, scope) -> list | None:
    """The outputs of ``eqn`` run as the interpreter's recipe says, or None where it leaves ``eqn`` to the
    policy: no recipe, not a dense matmul or convolution, a kept scope, or a transpose a custom VJP
    traces (no scope)."""
    r = interpreter.recipe
    if r is None or scope is None or not eligible(eqn) or "/".join(scope) in interpreter.recipe_kept:
        return None
    gemms = dot
    if eqn.primitive.name == "conv_general_dilated":
        from .recipe_conv import conv  # it builds on this module

        def gemms(*args, **kwargs):
            return conv(*args[:4], eqn.params, *args[4:], **kwargs)

    if not keeps_state(r):
        return [gemms(r, interpreter.compute, interpreter.output, _F32)(*invals)]
    path = "/".join(scope)
    run = active()
    if run is None:  # evaluation: the forward without state, no gradient
        fn = gemms(without_state(r), interpreter.compute, interpreter.output, _F32, trainable=False)
        return [fn(*invals)]
    if interpreter.nested:
        raise PolyampError(
            f"the {r.name!r} recipe keeps state, which polyamp threads only through dense matmuls and "
            "convolutions outside loops, conditionals, checkpoints and custom derivatives; scope "
            f"{path!r} is inside a {interpreter.nested[-1]}: keep it (keep=...) or use a recipe without state"
        )
    j, layer = run.matmul(path)
    scales = [run.scale(layer, op) for op in OPERANDS]
    return [gemms(r, interpreter.compute, interpreter.output, _F32, run, j)(*invals, *scales, run.calls)]


def without_state(recipe: Recipe) -> Recipe:
    """What a stateful recipe's autocast function runs outside ``mp.value_and_grad``'s step (evaluation):
    current scaling for delayed, nearest rounding for stochastic."""
    if recipe.kind == "delayed":
        recipe = replace(recipe, kind="tensorwise", history_len=None, amax_compute_algo=None)
    return replace(recipe, forward_rounding="nearest", grad_rounding="nearest")


def dot(recipe: Recipe, compute, output, preferred, run: Run | None = None, index: int = 0,
        trainable: bool = True):  # fmt: skip
    """``x @ w`` with the recipe's three quantized GEMMs (module docstring), products in ``compute``
    accumulated in ``preferred`` (float32), the result in ``output``; ``trainable=False``: its gradient
    raises (a stateful recipe outside its step).

    With ``run`` (a recipe that keeps state), the function takes ``(x, w, scale_x, scale_w, scale_g,
    calls)``: the delayed scales and the step's call counter; the seeds are ``run``'s positions for
    matmul ``index``, and the backward rule returns the amaxes of ``x``, ``w`` and ``g`` as the
    cotangents of the three scales (``recipe_state.py``)."""
    fq, bq, wq_ = recipe.quantize_forward, recipe.quantize_input_grad, recipe.quantize_weight_grad
    block = recipe.kind == "block"
    delayed = recipe.kind == "delayed"

    def matmul(a, b):  # a [..., K] @ b [K, N]
        dims = (((a.ndim - 1,), (0,)), ((), ()))
        return lax.dot_general(a.astype(compute), b.astype(compute), dims, preferred_element_type=preferred)

    def keys(calls, backward, count):
        if run is None:
            return [None] * count
        return [seed_key(calls, run.seed_position(index, i, backward)) for i in range(count)]

    def forward(x, w, sx=None, sw=None, sg=None, calls=None):
        kx, kw = keys(calls, False, 2)
        xq = quantize(x, recipe, "input", -1, sx if delayed else None, kx) if fq else x
        # torch's layout: its weight is w^T [N, K], blocked along K (its elements index a random stream)
        wq = quantize(w, recipe, "weight", -1, sw if delayed else None, kw, transposed=True) if fq else w
        amaxes = (_amax(x.astype(_F32)), _amax(w.astype(_F32))) if delayed else ()
        return matmul(xq, wq).astype(output), (x, w, xq, wq, sg, calls, amaxes)

    def backward(res, g):
        if not trainable:
            refuse_gradient(recipe)
        x, w, xq, wq, sg, calls, amaxes = res
        n, k = w.shape[1], w.shape[0]
        g2, x2 = g.reshape(-1, n), x.reshape(-1, k)
        ks = iter(keys(calls, True, calls_per_matmul(recipe)[1]))
        sg = sg if delayed else None
        once = quantize(g2, recipe, "grad", -1, sg, next(ks)) if (bq or wq_) and not block else None
        gq, w_op = g2, w
        if bq:
            gq = quantize(g2, recipe, "grad", -1, None, next(ks)) if block else once
            w_op = wq
            if block and not recipe.weight_2d:  # torch's W^T, w here, blocked along N
                w_op = quantize(w, recipe, "weight", -1, None, next(ks))
        dx = matmul(gq, w_op.T).reshape(x.shape).astype(x.dtype)
        x_op, g_op = x2, g2
        if wq_:  # the operands g^T and x^T of dW = (g^T x)^T, blocked along M (Hadamard tiles first)
            gm, xm = (hadamard_tiles(g2, 0), hadamard_tiles(x2, 0)) if recipe.hadamard else (g2, x2)
            g_op = quantize(gm, recipe, "grad", 0, None, next(ks), transposed=True) if block else once
            x_op = (
                quantize(xm, recipe, "input", 0, None, next(ks), transposed=True)
                if block
                else xq.reshape(-1, k)
            )
        dw = matmul(x_op.T, g_op).astype(w.dtype)
        if run is None:
            return dx, dw
        d_scales = (*amaxes, _amax(g2.astype(_F32))) if delayed else (jnp.float32(0),) * 3
        return (dx, dw, *d_scales, None)

    fn = jax.custom_vjp(lambda *args: forward(*args)[0])
    fn.defvjp(forward, backward)
    return fn


def refuse_gradient(recipe: Recipe):
    """The error of a stateful recipe's gradient taken outside ``mp.value_and_grad``'s step."""
    raise PolyampError(
        f"the {recipe.name!r} recipe keeps state between steps (amax histories, a stochastic-"
        "rounding counter): take its gradients with mp.value_and_grad(f)(..., state=state) (or "
        "mp.grad), state = mp.init(), which threads that state through the step; outside it the "
        "autocast function only evaluates (current scaling, nearest rounding)"
    )


def kept_layers(jaxpr, keep: tuple[str, ...]) -> set[str]:
    """The scope paths (joined by "/") whose dense matmuls and convolutions the keep list keeps;
    PolyampError for a pattern that matches none."""
    paths = list(dict.fromkeys(_layer_paths(jaxpr, ())))
    kept: set[str] = set()
    for entry in keep:
        if entry in ("first", "last"):
            if paths:
                kept.add(paths[0] if entry == "first" else paths[-1])
            continue
        found = [p for p in paths if fnmatch.fnmatchcase(p, entry)]
        if not found:
            scopes = ", ".join(map(repr, paths[:20])) or "none"
            raise PolyampError(f"the recipe's keep entry {entry!r} matches no dense matmul's or "
                               f"convolution's scope; their scopes: {scopes}")  # fmt: skip
        kept.update(found)
    return kept


def _layer_paths(jaxpr, scope: tuple[str, ...]):
    """The scope path of each dense matmul and convolution (:func:`eligible`), in trace order,
    sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        path = scope + name_scopes(eqn)
        if eligible(eqn):
            yield "/".join(path)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _layer_paths(inner, path)
