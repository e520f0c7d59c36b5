"""Emulated low-precision training in JAX: ``polyamp.recipes`` on the dense matmuls and convolutions of
an autocast function.

``mp.autocast(fn)`` of a ``MixedPrecision`` made from a recipe runs ``fn`` through the autocast
interpreter (``autocast.py``), which hands each dense matmul (:func:`dense_form`: a ``dot_general``
without batch dimensions contracting trailing axes of the activations with a weight: ``x @ w``, ``x @
w.T``, Equinox's vmapped ``W @ x``, an NNX ``LinearGeneral`` kernel of more axes; transposed and
flattened to ``x [..., K] @ w [K, N]`` by :func:`as_dense`) to :func:`dot`: the three GEMMs of
the recipe, as ``polyamp/torch/recipe.py`` describes, in a ``jax.custom_vjp``:

    forward        y  = Qf(x) @ Qf(w)           blocks along K (x's last axis, w's first)
    input grad     dx = Qb(g) @ Qf'(w)^T        blocks along N (g's last axis, w's last)
    weight grad    dw = Qf'(x)^T @ Qb'(g)       blocks along the rows M of x and g

Each operand is quantized as torch's layout has it (``w^T`` for the forward weight, ``x^T`` and ``g^T``
for the weight gradient, blocked along their last axis), so stochastic rounding indexes the same
elements as torch's recipe; the transposed operands are never copied: ``w``, ``x`` and ``g`` are blocked
along their axis 0 in place, indexed as their transposes (``quantize_operand(..., transposed=True)``). With
``hadamard=True`` (NVFP4) ``x^T`` and ``g^T`` are first multiplied by the random Hadamard matrix in
tiles of 16 along ``M`` (:func:`hadamard_tiles`, ``polyamp/numerics/hadamard.py``'s
float32 butterfly; ``M`` zero padded to a multiple of 16).

Convolutions (``conv_general_dilated`` without batch groups) run as the implicit GEMMs they are, by
``recipe_conv.py``'s :func:`~polyamp.jax.recipe_conv.conv`; batched matmuls (attention's scores and
values) run as the bf16 policy does. A weight is a var of :func:`weight_names` (a leaf of an NNX /
Equinox module among the arguments, else any argument leaf, through casts and reshapes). A layer is
:func:`layer_name`: its module path or ``jax.named_scope`` path (``scopes.layer_of``), outside any scope
its weight's name; the keep list's ``first`` / ``last`` are the first and last quantizable layer, dense
matmul or convolution, in trace order, other entries ``fnmatch`` patterns over the names, and
:func:`record` writes the ``RecipeLayers`` that ``mp.recipe_layers`` shows.

Quantization is JAX ops, bit-identical to the numpy core (``tests/test_recipes_frameworks.py``): per-tensor
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
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ..errors import PolyampError
from ..numerics.hadamard import hadamard_tiles
from ..recipe_gemms import FORWARD, WEIGHT_GRAD, backward_operands, forward_operands
from ..recipe_layers import RecipeLayers
from ..recipes import Recipe, recipe_spec
from .recipe_conv import conv
from .recipe_operands import amax_of, quantize_operand, refuse_gradient
from .recipe_state import OPERANDS, Run, active, calls_per_matmul, keeps_state, seed_key
from .scopes import layer_of, name_scopes

_F32 = jnp.float32


_CARRY = frozenset({"convert_element_type", "transpose", "reshape", "copy", "squeeze", "expand_dims",
                    "reduce_precision"})  # fmt: skip
# the primitives of the bodies a stateful recipe cannot reach, as the user wrote them
_WRITTEN_AS = {"remat2": "jax.checkpoint (jax.remat)", "checkpoint": "jax.checkpoint (jax.remat)",
               "scan": "scan", "while": "while loop (lax.while_loop / fori_loop)",
               "cond": "lax.cond / lax.switch", "custom_jvp_call": "jax.custom_jvp function",
               "custom_vjp_call": "jax.custom_vjp function"}  # fmt: skip


@dataclass(frozen=True)
class Dense:
    """How a ``dot_general`` runs as a dense layer's ``x [..., K] @ w [K, N]``: ``weight``, the operand
    (0: lhs, 1: rhs) that is the weight; ``k``, the number of trailing axes of the activations it
    contracts (flattened into K); ``order``, the permutation of ``w``'s axes to (contracted, in the
    activations' order, then free; flattened into K and N)."""

    weight: int
    k: int
    order: tuple[int, ...]


def weight_names(jaxpr, names: dict) -> dict:
    """``names`` (the jaxpr's input vars that hold weights -> their names) extended to every var of
    ``jaxpr`` and of its sub-jaxprs that holds one: through casts, transposes and reshapes, and into the
    sub-jaxprs whose inputs are the equation's (``jit``, ``checkpoint``, ``custom_jvp``, ``scan``, ...)."""
    out = dict(names)
    _mark(jaxpr, out)
    return out


def _mark(jaxpr, names: dict) -> None:
    for eqn in jaxpr.eqns:
        src = [None if isinstance(v, jcore.Literal) else names.get(v) for v in eqn.invars]
        if eqn.primitive.name in _CARRY and src and src[0] is not None:
            names.update((v, src[0]) for v in eqn.outvars if not isinstance(v, jcore.DropVar))
        for sub in jcore.jaxprs_in_params(eqn.params):
            ins = src if len(sub.invars) == len(src) else src[1:] if len(sub.invars) == len(src) - 1 else ()
            names.update((v, n) for v, n in zip(sub.invars, ins) if n is not None)
            _mark(sub, names)


def _floating(*avals) -> bool:
    return all(jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float64 for a in avals)


def dense_form(eqn, weights=()) -> Dense | None:
    """A ``dot_general`` without batch dimensions of floating operands narrower than float64 that is a
    dense layer's matmul, or None. Today's form ``x @ w`` (``x``'s last axis with the first of a 2-d
    ``w``) always is; otherwise one operand must be a weight (a var in ``weights``; the rhs preferred
    when both are), contracted on any of its axes with trailing axes of the other: ``x @ w.T``, ``w @
    x`` (Equinox's vmapped ``Linear``), an NNX ``LinearGeneral`` / einsum kernel of more axes."""
    if eqn.primitive.name != "dot_general":
        return None
    lhs, rhs = (v.aval for v in eqn.invars)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb or not _floating(lhs, rhs):
        return None
    lc, rc = tuple(lc), tuple(rc)
    if rhs.ndim == 2 and rc == (0,) and lhs.ndim >= 1 and lc == (lhs.ndim - 1,):
        return Dense(1, 1, (0, 1))
    for w in (1, 0):
        a_aval, w_aval = (lhs, rhs) if w == 1 else (rhs, lhs)
        ac, wc = (lc, rc) if w == 1 else (rc, lc)
        k = len(ac)
        if not (0 < k < w_aval.ndim and ac == tuple(range(a_aval.ndim - k, a_aval.ndim))):
            continue
        var, other = eqn.invars[w], eqn.invars[1 - w]
        if var in weights and (w == 1 or other not in weights):
            return Dense(w, k, (*wc, *(d for d in range(w_aval.ndim) if d not in wc)))
    return None


def unsupported(eqn, weights=()) -> str | None:
    """Why a matmul of a weight (a var in ``weights``) is not quantized, in the record's words, or None
    when ``eqn`` is no such matmul or is quantized."""
    name = eqn.primitive.name
    if name not in ("dot_general", "conv_general_dilated") or eligible(eqn, weights):
        return None
    if not any(v in weights for v in eqn.invars if not isinstance(v, jcore.Literal)):
        return None
    avals = [v.aval for v in eqn.invars]
    if not _floating(*avals):
        dtypes = "/".join(str(a.dtype) for a in avals)
        return f"unsupported: {name}: {dtypes} operands (recipes take floats narrower than float64)"
    if name == "conv_general_dilated":
        return (f"unsupported: conv_general_dilated: batch_group_count={eqn.params['batch_group_count']} "
                "has no recipe GEMM; it computes in the compute dtype")  # fmt: skip
    return (f"unsupported: dot_general: dimension numbers {eqn.params['dimension_numbers']} are no dense "
            "layer's x @ w; it computes in the compute dtype")  # fmt: skip


def eligible(eqn, weights=()) -> bool:
    """A dense matmul (:func:`dense_form`) or a convolution with ``batch_group_count == 1`` (any feature
    groups), of floating operands narrower than float64."""
    if eqn.primitive.name == "conv_general_dilated":
        return _floating(*(v.aval for v in eqn.invars)) and eqn.params["batch_group_count"] == 1
    return dense_form(eqn, weights) is not None


def layer_name(eqn, scope: tuple[str, ...], weights=None) -> str:
    """The layer of a matmul or convolution: its scope's (``scopes.layer_of``), or outside any scope
    the name of its weight (``weights``: var -> name), else ""."""
    layer = layer_of(scope)
    if layer or not weights:
        return layer
    if eqn.primitive.name == "conv_general_dilated":
        held = eqn.invars[1:]  # the kernel
    else:
        form = dense_form(eqn, weights)
        held = [eqn.invars[form.weight]] if form is not None else eqn.invars
    return next((weights[v] for v in held if not isinstance(v, jcore.Literal) and v in weights), "")


def as_dense(form: Dense, gemms, x, w, *extra):
    """``gemms(x2, w2, *extra)`` (a ``[..., K] @ [K, N]`` matmul) on the operands of ``form`` reshaped
    to it, the result back in the ``dot_general``'s layout; the plain ``x @ w`` unchanged."""
    if form == Dense(1, 1, (0, 1)) and w.ndim == 2:
        return gemms(x, w, *extra)
    lead = x.shape[: x.ndim - form.k]
    wt = lax.transpose(w, form.order) if form.order != tuple(range(w.ndim)) else w
    free = wt.shape[form.k :]
    k, n = int(np.prod(wt.shape[: form.k])), int(np.prod(free))
    y = gemms(x.reshape(*lead, k), wt.reshape(k, n), *extra).reshape(*lead, *free)
    if form.weight == 0:  # the dot_general puts w's free axes first
        y = lax.transpose(y, (*range(len(lead), y.ndim), *range(len(lead))))
    return y


def quantized(interpreter, eqn, invals, scope) -> list | None:
    """The outputs of ``eqn`` run as the interpreter's recipe says, or None where it leaves ``eqn`` to the
    policy: no recipe, not a dense matmul or convolution, a kept layer, or a transpose a custom VJP
    traces (no scope)."""
    r = interpreter.recipe
    weights = interpreter.weights
    if r is None or scope is None or not eligible(eqn, weights):
        return None
    path = layer_name(eqn, scope, weights)
    if path in interpreter.recipe_kept:
        return None
    if eqn.primitive.name == "conv_general_dilated":
        def gemms(*args, **kwargs):
            return conv(*args[:4], eqn.params, *args[4:], **kwargs)

        def call(fn, *operands):
            return fn(*operands)
    else:
        form = dense_form(eqn, weights)
        gemms = dot

        def call(fn, lhs, rhs, *extra):
            x, w = (lhs, rhs) if form.weight == 1 else (rhs, lhs)
            return as_dense(form, fn, x, w, *extra)

    if not keeps_state(r):
        return [call(gemms(r, interpreter.compute, interpreter.output, _F32), *invals)]
    run = active()
    if run is None:  # evaluation: the forward without state, no gradient
        fn = gemms(without_state(r), interpreter.compute, interpreter.output, _F32, trainable=False)
        return [call(fn, *invals)]
    if interpreter.nested:
        where = _WRITTEN_AS.get(interpreter.nested[-1], interpreter.nested[-1])
        raise PolyampError(
            f"the {r.name!r} recipe keeps state, which polyamp threads only through dense matmuls and "
            "convolutions outside loops, conditionals, checkpoints and custom derivatives; layer "
            f"{path!r} is inside a {where}: keep it (keep=...) or use a recipe without state"
        )
    j, layer = run.matmul(path)
    scales = [run.scale(layer, op) for op in OPERANDS]
    fn = gemms(r, interpreter.compute, interpreter.output, _F32, run, j)
    return [call(fn, *invals, *scales, run.calls)]


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
    delayed = recipe.kind == "delayed"

    def matmul(a, b):  # a [..., K] @ b [K, N]
        dims = (((a.ndim - 1,), (0,)), ((), ()))
        return lax.dot_general(a.astype(compute), b.astype(compute), dims, preferred_element_type=preferred)

    def keys(calls, backward, count):
        if run is None:
            return [None] * count
        return [seed_key(calls, run.seed_position(index, i, backward)) for i in range(count)]

    def quantizer(keys, scales):
        """``recipe_gemms``' quantize, each call with the next of ``keys``: each operand blocked along its
        last axis as torch's layout has it (the forward's w^T, the weight gradient's x^T and g^T:
        ``transposed``; the input gradient's torch W^T is w here)."""
        keys = iter(keys)

        def quantize(t, operand, gemm):
            transposed = gemm == WEIGHT_GRAD or (gemm, operand) == (FORWARD, "weight")
            scale = scales[operand] if delayed else None
            return quantize_operand(t, recipe, operand, 0 if gemm == WEIGHT_GRAD else -1, scale, next(keys),
                                    transposed=transposed)  # fmt: skip

        return quantize

    def forward(x, w, sx=None, sw=None, sg=None, calls=None):
        quantize = quantizer(keys(calls, False, 2), {"input": sx, "weight": sw})
        xq, wq = forward_operands(recipe, quantize, x, w)
        amaxes = (amax_of(x.astype(_F32)), amax_of(w.astype(_F32))) if delayed else ()
        return matmul(xq, wq).astype(output), (x, w, xq, wq, sg, calls, amaxes)

    def backward(res, g):
        if not trainable:
            refuse_gradient(recipe)
        x, w, xq, wq, sg, calls, amaxes = res
        n, k = w.shape[1], w.shape[0]
        g2, x2 = g.reshape(-1, n), x.reshape(-1, k)
        quantize = quantizer(keys(calls, True, calls_per_matmul(recipe)[1]), {"grad": sg})
        (gq, w_op), (g_op, x_op) = backward_operands(recipe, quantize, g2, x2, w, xq.reshape(-1, k), wq,
                                                     hadamard=_hadamard_rows)  # fmt: skip
        dx = matmul(gq, w_op.T).reshape(x.shape).astype(x.dtype)
        dw = matmul(x_op.T, g_op).astype(w.dtype)
        if run is None:
            return dx, dw
        d_scales = (*amaxes, amax_of(g2.astype(_F32))) if delayed else (jnp.float32(0),) * 3
        return (dx, dw, *d_scales, None)

    fn = jax.custom_vjp(lambda *args: forward(*args)[0])
    fn.defvjp(forward, backward)
    return fn


def _hadamard_rows(t, _operand: str):
    return hadamard_tiles(t, 0)


def kept_layers(jaxpr, keep: tuple[str, ...], weights=None) -> set[str]:
    """The layers (:func:`layer_name`) whose dense matmuls and convolutions the keep list keeps;
    PolyampError for a pattern that matches none."""
    paths = dict.fromkeys(p for p, why in _layers(jaxpr, (), weights or {}) if why is None)
    return _keep(list(paths), keep)[0]


def record(jaxpr, recipe: Recipe, weights=None) -> tuple[RecipeLayers, set[str]]:
    """The ``RecipeLayers`` of ``jaxpr`` under ``recipe`` (every dense matmul and convolution, by layer:
    quantized, kept and why; matmuls of a weight the recipe cannot quantize, unsupported and why) and
    the set of kept layers; PolyampError for a keep pattern that matches none."""
    found: dict[str, str | None] = {}
    for path, why in _layers(jaxpr, (), weights or {}):
        if found.get(path, "") is not None:  # a quantizable matmul wins over an unsupported one
            found[path] = why
    eligible_paths = [p for p, why in found.items() if why is None]
    kept, reasons = _keep(eligible_paths, recipe.keep)
    out = RecipeLayers(recipe_spec(recipe))
    for path, why in found.items():
        out.add(path, reasons.get(path) if why is None else why)
    return out, kept


def _keep(paths: list[str], keep: tuple[str, ...]) -> tuple[set[str], dict[str, str]]:
    """The kept layers among ``paths`` (in trace order) and, for each, the first entry keeping it."""
    reasons: dict[str, str] = {}
    for entry in keep:
        if entry in ("first", "last"):
            found = paths[:1] if entry == "first" else paths[-1:]
        else:
            found = [p for p in paths if fnmatch.fnmatchcase(p, entry)]
            if not found:
                scopes = ", ".join(map(repr, paths[:20])) or "none"
                raise PolyampError(f"the recipe's keep entry {entry!r} matches no dense matmul's or "
                                   f"convolution's scope; their scopes: {scopes}")  # fmt: skip
        for p in found:
            reasons.setdefault(p, f"keep {entry!r}")
    return set(reasons), reasons


def _layers(jaxpr, scope: tuple[str, ...], weights):
    """``(layer, None)`` for each dense matmul and convolution (:func:`eligible`), ``(layer, reason)``
    for each matmul of a weight that is not, in trace order, sub-jaxprs included."""
    for eqn in jaxpr.eqns:
        path = scope + name_scopes(eqn)
        if eligible(eqn, weights):
            yield layer_name(eqn, path, weights), None
        else:
            why = unsupported(eqn, weights)
            if why is not None:
                yield layer_name(eqn, path, weights), why
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _layers(sub, path, weights)
