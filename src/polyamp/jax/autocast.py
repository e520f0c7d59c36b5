"""Op-level autocast for JAX: trace a function to a jaxpr and re-evaluate it with a dtype rule per
primitive, binding each primitive again on the (cast) values, so the result composes with ``jit``,
``grad`` and ``vmap`` like any JAX function.

Every equation falls in one class of :class:`AutocastRules` (looked up by primitive name):

- ``allow``: floating inputs are cast to the compute dtype; a primitive with a
  ``preferred_element_type`` (``dot_general``, ``conv_general_dilated``) accumulates in float32;
  floating outputs take the policy's output dtype. Matmuls and convolutions also get a custom
  VJP whose transposes run the same way (compute-dtype cotangents and operands, float32
  accumulation), unless ``low_precision_backward=False``. What XLA CPU needs of a bfloat16
  matmul's layout is ``layout.py``'s.
- ``keep_fp32``: reductions, cumulative sums, exp/log/logistic, rsqrt/sqrt/pow, linear algebra:
  floating inputs narrower than float32 are widened to float32.
- ``follow``: elementwise and structural ops: all floating inputs take the widest floating
  dtype among them; weakly typed inputs (Python scalars, literals) do not vote.
- ``as_is``: variadic pass-through ops whose operands are independent (``device_put``,
  ``optimization_barrier``): inputs untouched.
- ``original``: ops whose parameters fix their dtypes (``scatter``, a generic ``reduce``,
  callbacks): inputs are cast back to the dtypes they had in the traced function.

A primitive in no class runs as ``original`` and a one-time RuntimeWarning names it. Integer and
boolean values are never cast; float64 is left alone. Sub-jaxprs are re-evaluated with the same
rules: ``jit``/``closed_call`` are inlined, ``remat`` is re-wrapped in ``jax.checkpoint``,
``scan``/``while``/``cond`` are rebuilt with ``lax.scan``/``lax.while_loop``/``lax.switch``
(loop carries and branch outputs keep the dtypes they had, so loop types stay fixed), and
``custom_jvp``/``custom_vjp`` functions get an autocast primal while their custom derivative rule
runs as written, in the dtypes the function was traced with.

Layers kept in float32 (``keep_fp32``, ``polyamp.doctor``'s recommendation): an equation's layer is
the module path of the NNX / Equinox module whose call holds it (``modules.py`` names them while
``fn`` is traced; ``blocks.0.attn.query``), else its ``jax.named_scope`` path, the ``Scope`` entries of
its ``source_info.name_stack`` joined by "/" and prefixed by those of the equations whose sub-jaxpr
holds it (``block1/ff1``; the doctor's layer names).
An equation whose path a ``keep_fp32`` name keeps (``mixed_precision.kept``: the name or one of its
ancestors) runs as traced, on its inputs cast back to the traced dtypes (float32), with JAX's own
derivative; a ``jit`` or a loop under a kept name runs whole that way. A parameter that equations outside
any scope read is a layer named by its pytree path within its argument (``embed``, ``blocks/0/w``; the
doctor names it so too): keeping it keeps those equations (``jit`` and ``closed_call`` looked into). Names
that keep nothing raise (``mixed_precision.unmatched_layers``) when the function is traced.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ..errors import PolyampError
from ..mixed_precision import kept, unmatched_layers
from . import layout, recipe
from .modules import leaf_names, model_leaves, module_scopes
from .scopes import layer_of, name_scopes, scope_paths
from .tree import is_array

_REDUCTIONS = ("reduce_sum reduce_prod reduce_max reduce_min argmax argmin cumsum cumprod cumlogsumexp "
               "cummax cummin reduce_window_sum reduce_window_max reduce_window_min psum psum_invariant "
               "pmax pmin reduce_scatter")  # fmt: skip
_FP32_MATH = ("exp exp2 expm1 log log1p logistic rsqrt sqrt cbrt pow tan sinh cosh acos asin atan acosh "
              "asinh atanh erfc erf_inv lgamma digamma polygamma zeta igamma igammac igamma_grad_a "
              "bessel_i0e bessel_i1e regularized_incomplete_beta")  # fmt: skip
_LINALG = (
    "cholesky cholesky_update eig eigh lu qr svd schur triangular_solve tridiagonal_solve hessenberg fft"
)
_FOLLOW = (
    # elementwise
    "add sub mul div rem neg abs sign floor ceil round max min nextafter square integer_pow tanh sin cos "
    "atan2 erf is_finite eq ne lt le gt ge eq_to le_to lt_to select_n clamp and or not xor "
    "shift_left shift_right_arithmetic shift_right_logical population_count clz real imag conj complex "
    "add_any mulhi "
    # structural
    "convert_element_type reduce_precision bitcast_convert_type broadcast_in_dim reshape transpose "
    "squeeze slice dynamic_slice dynamic_update_slice gather concatenate pad rev split "
    "iota copy stop_gradient name sort top_k approx_top_k reduce_and reduce_or reduce_xor "
    "sharding_constraint layout_constraint with_memory_space_constraint reshard pin unpin "
    "all_gather all_gather_invariant ppermute all_to_all pbroadcast axis_index tile zeros_like "
    "random_bits random_seed random_wrap random_unwrap random_split random_fold_in threefry2x32 "
    "rng_bit_generator rng_uniform"
)
_AS_IS = "device_put optimization_barrier pvary tie"
_ORIGINAL = (
    "scatter scatter-add scatter-sub scatter-mul scatter-min scatter-max reduce reduce_window "
    "select_and_scatter_add select_and_gather_add select_and_scatter custom_linear_solve "
    "linear_call composite ffi_call pure_callback io_callback debug_callback debug_print"
)

CLASSES = ("allow", "keep_fp32", "follow", "as_is", "original")


@dataclass(frozen=True)
class AutocastRules:
    """Which rule class each primitive name belongs to (see the module docstring), and whether
    matmul/convolution gradients are computed in the compute dtype too (``low_precision_backward``;
    with it, forward-mode ``jax.jvp`` of the rewritten function is not available, as for any
    ``custom_vjp``).

    >>> rules = DEFAULT_RULES.extend(keep_fp32=["tanh"])  # doctest: +SKIP
    >>> mp.autocast(loss_fn, rules=rules)                 # doctest: +SKIP
    """

    allow: frozenset[str] = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
    keep_fp32: frozenset[str] = frozenset(f"{_REDUCTIONS} {_FP32_MATH} {_LINALG}".split())
    follow: frozenset[str] = frozenset(_FOLLOW.split())
    as_is: frozenset[str] = frozenset(_AS_IS.split())
    original: frozenset[str] = frozenset(_ORIGINAL.split())
    low_precision_backward: bool = True

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for cls in CLASSES:
            names = getattr(self, cls)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise PolyampError(f"AutocastRules.{cls} must be a collection of primitive names; "
                                   f"received {names!r}")  # fmt: skip
            object.__setattr__(self, cls, frozenset(names))
            for name in names:
                if name in seen:
                    raise PolyampError(f"primitive {name!r} is in both {seen[name]!r} and {cls!r}; "
                                       "a primitive belongs to one class")  # fmt: skip
                seen[name] = cls
        if not isinstance(self.low_precision_backward, bool):
            raise PolyampError(f"low_precision_backward must be True or False; received "
                               f"{self.low_precision_backward!r}")  # fmt: skip

    def extend(self, **classes) -> AutocastRules:
        """New rules with the given names moved into the given classes, e.g.
        ``extend(allow=["my_matmul"], keep_fp32=["tanh"])``."""
        unknown = [key for key in classes if key not in CLASSES]
        if unknown:
            raise PolyampError(f"unknown autocast rule class {unknown[0]!r}; accepted: {', '.join(CLASSES)}")
        moved: set[str] = set()
        for key, names in classes.items():
            if isinstance(names, str):
                raise PolyampError(f"{key}= takes a list of primitive names, got the string {names!r}")
            moved |= set(names)
        return replace(self, **{cls: (getattr(self, cls) - moved) | frozenset(classes.get(cls, ()))
                                for cls in CLASSES})  # fmt: skip

    def kind(self, name: str) -> str | None:
        for cls in CLASSES:
            if name in getattr(self, cls):
                return cls
        return None


DEFAULT_RULES = AutocastRules()

_warned: set[str] = set()


def _warn_unknown(name: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"polyamp autocast has no rule for the JAX primitive {name!r}: it runs in the dtypes of "
            "the original function (its inputs are cast back to them). Choose a class with "
            f"AutocastRules.extend(...), e.g. DEFAULT_RULES.extend(follow=[{name!r}])",
            RuntimeWarning,
            stacklevel=4,
        )


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _dtype(x):
    return jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype


def _cast(x, dtype):
    """``x`` as ``dtype`` when both are floating and they differ; anything else unchanged."""
    have = _dtype(x)
    if dtype is None or have == dtype or not (_is_float(have) and _is_float(dtype)):
        return x
    return lax.convert_element_type(x, dtype)


def _cast_all(values, dtypes):
    return [_cast(x, d) for x, d in zip(values, dtypes)]


def _avals_dtypes(atoms):
    return [a.aval.dtype for a in atoms]


_F32 = np.dtype(np.float32)
_BILINEAR = frozenset({"dot_general", "conv_general_dilated"})


class Interpreter:
    """Evaluates jaxprs with the autocast rules for one compute and output dtype."""

    def __init__(self, compute: str, output: str, rules: AutocastRules = DEFAULT_RULES,
                 keep_fp32: tuple[str, ...] = (), recipe=None):  # fmt: skip
        self.compute = jnp.dtype(compute)
        self.output = jnp.dtype(output)
        self.rules = rules
        self.keep_fp32 = tuple(keep_fp32)
        # dense matmuls and convolutions quantized but in these scopes
        self.recipe, self.recipe_kept = recipe, set()
        self.weights: dict = {}  # the vars that hold weights -> their names (recipe.weight_names)
        self.leaves: dict[int, str] = {}  # id of an argument leaf's value -> its name, during one call
        self.read_outside: dict[str, None] = {}  # the names of those that equations outside any scope read
        self.nested: list[str] = []  # the loops, checkpoints, ... being evaluated (for recipe.quantized)

    # -- jaxprs -----------------------------------------------------------------------------------
    def eval_jaxpr(self, jaxpr, consts, args, scope: tuple[str, ...] | None = ()) -> list:
        """Evaluate ``jaxpr``; ``scope``: the scope path it runs under (None: keep no layer in float32,
        for the transposes that custom VJPs trace)."""
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        folds = "dot_general" in self.rules.allow
        swapped, skip = layout.fold_transposed_dots(jaxpr) if folds else ({}, set())
        for eqn in jaxpr.eqns:
            if id(eqn) in skip:
                continue
            eqn = swapped.get(id(eqn), eqn)
            path = None if scope is None else scope + name_scopes(eqn)
            invals = [read(v) for v in eqn.invars]
            if self._kept(eqn, invals, path):
                outs = _bind_original(eqn, *invals)
            else:
                outs = self.eval_eqn(eqn, invals, path)
            for var, val in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def eval_closed(self, closed, args, scope: tuple[str, ...] | None = ()) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, scope)

    def _kept(self, eqn, invals, path) -> bool:
        """Whether ``eqn`` (at scope ``path``) computes in float32 for ``keep_fp32``."""
        if not self.keep_fp32 or path is None:
            return False
        if path:
            return kept(layer_of(path), self.keep_fp32) is not None
        if eqn.primitive.name in _LOOKED_INTO or not self.leaves:
            return False
        names = [self.leaves[id(x)] for x in invals if id(x) in self.leaves]
        self.read_outside.update(dict.fromkeys(names))
        return any(kept(name, self.keep_fp32) for name in names)

    # -- one equation ---------------------------------------------------------------------------
    def eval_eqn(self, eqn, invals, scope: tuple[str, ...] | None = ()) -> list:
        """One equation under the rules; ``scope``: its own scope path (for its sub-jaxprs)."""
        name = eqn.primitive.name
        handler = _STRUCTURED.get(name)
        if handler is not None and name in _LOOKED_INTO:
            return handler(self, eqn, invals, scope)
        if handler is not None:  # a body traced apart from the step: a recipe's state cannot reach it
            self.nested.append(name)
            try:
                return handler(self, eqn, invals, scope)
            finally:
                self.nested.pop()
        kind = self.rules.kind(name)
        if kind is None:
            _warn_unknown(name)
            kind = "original"
        if kind == "allow":
            quantized = recipe.quantized(self, eqn, invals, scope)
            return self._allow(eqn, invals) if quantized is None else quantized
        if kind == "keep_fp32":
            invals = [_cast(x, _F32) if _is_float(_dtype(x)) and _dtype(x).itemsize < 4 else x
                      for x in invals]  # fmt: skip
        elif kind == "follow":
            invals = self._widest(eqn, invals)
        elif kind == "original":
            return _bind_original(eqn, *invals)
        return _bind(eqn, invals, eqn.params)

    def _allow(self, eqn, invals) -> list:
        """Run in the compute dtype, accumulating in float32 where the primitive can.

        With ``rules.low_precision_backward``, a matmul or convolution gets a custom VJP: the
        cotangents are cast to the compute dtype too and the primitive's transposes (from
        ``jax.linear_transpose``) are evaluated with these same rules, so the backward matmuls
        are compute-dtype-in/float32-accumulate too (JAX's own transpose would multiply a float32
        cotangent by a compute-dtype operand, which XLA CPU runs slower than float32).
        """
        low = [_is_float(_dtype(x)) and _dtype(x) != np.float64 for x in invals]
        if not any(low):
            return _bind(eqn, invals, eqn.params)
        accumulate = "preferred_element_type" in eqn.params
        params = {**eqn.params, "preferred_element_type": _F32} if accumulate else eqn.params

        def lower(xs):
            return [_cast(x, self.compute) if is_low else x for x, is_low in zip(xs, low)]

        def run(*xs):
            out = layout.bind_allowed(eqn, lower(xs), params, self.compute, _bind)
            return _cast_all(out, [self.output] * len(eqn.outvars))

        if not (self.rules.low_precision_backward and eqn.primitive.name in _BILINEAR):
            return run(*invals)
        in_dtypes = [_dtype(x) for x in invals]
        native = {**eqn.params, "preferred_element_type": self.compute} if accumulate else eqn.params

        def fwd(*xs):
            return run(*xs), lower(xs)  # the casts are shared with run's after CSE

        def bwd(lows, cts):
            cts = _cast_all(list(cts), [self.compute] * len(cts))
            grads = []
            for i, (x, dtype) in enumerate(zip(lows, in_dtypes)):
                if not low[i]:
                    grads.append(None)
                    continue

                def linear(xi, i=i):
                    return _bind(eqn, [*lows[:i], xi, *lows[i + 1 :]], native)

                (grad,) = self.call(jax.linear_transpose(linear, x), cts)
                grads.append(_cast(grad, dtype))
            return tuple(grads)

        fn = jax.custom_vjp(run)
        fn.defvjp(fwd, bwd)
        return fn(*invals)

    def call(self, fn, *args) -> list:
        """``fn(*args)`` evaluated with the rules; the flat list of outputs."""
        closed = jax.make_jaxpr(fn)(*args)
        return self.eval_closed(closed, jax.tree.leaves(args), None)

    @staticmethod
    def _widest(eqn, invals) -> list:
        floats = [(x, v) for x, v in zip(invals, eqn.invars) if _is_float(_dtype(x))]
        if len(floats) < 2:
            return invals
        voters = [x for x, v in floats if not v.aval.weak_type] or [x for x, _ in floats]
        target = functools.reduce(jnp.promote_types, (_dtype(x) for x in voters))
        return [_cast(x, target) for x in invals]

    # -- primitives with sub-jaxprs ------------------------------------------------------------------
    def _inline(self, eqn, invals, scope):
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if isinstance(closed, jcore.ClosedJaxpr):
            return self.eval_closed(closed, invals, scope)
        return self.eval_jaxpr(closed, (), invals, scope)

    def _remat(self, eqn, invals, scope):
        p = eqn.params

        def body(xs):
            return self.eval_jaxpr(p["jaxpr"], (), xs, scope)

        return jax.checkpoint(lambda *xs: body(xs), prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals)

    def _scan(self, eqn, invals, scope):
        p = eqn.params
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        carry_dtypes = _avals_dtypes(eqn.invars[nc : nc + ncarry])

        def body(c, x):
            outs = self.eval_closed(p["jaxpr"], [*consts, *c, *x], scope)
            return _cast_all(outs[:ncarry], carry_dtypes), outs[ncarry:]

        carry, ys = lax.scan(body, _cast_all(carry, carry_dtypes), xs, length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])  # fmt: skip
        return [*carry, *ys]

    def _while(self, eqn, invals, scope):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
        dtypes = _avals_dtypes(eqn.invars[nc + nb :])

        def cond(c):
            return self.eval_closed(p["cond_jaxpr"], [*cconsts, *c], scope)[0]

        def body(c):
            return _cast_all(self.eval_closed(p["body_jaxpr"], [*bconsts, *c], scope), dtypes)

        return list(lax.while_loop(cond, body, _cast_all(carry, dtypes)))

    def _cond(self, eqn, invals, scope):
        index, ops = invals[0], invals[1:]
        dtypes = _avals_dtypes(eqn.outvars)
        branches = [
            lambda *xs, b=b: _cast_all(self.eval_closed(b, xs, scope), dtypes) for b in eqn.params["branches"]
        ]
        return list(lax.switch(index, branches, *ops))

    def _custom_jvp(self, eqn, invals, scope):
        """Autocast primal; the jvp rule runs as written on the inputs cast to their traced dtypes."""
        call = eqn.params["call_jaxpr"]
        dtypes = _avals_dtypes(eqn.invars)
        original = functools.partial(_bind_original, eqn)
        primal = jax.custom_jvp(lambda *xs: self.eval_closed(call, xs, scope))

        def jvp(primals, tangents):
            outs = primal(*primals)
            _, t_out = jax.jvp(original, _cast_all(primals, dtypes), _cast_all(tangents, dtypes))
            return outs, _cast_all(t_out, [_dtype(o) for o in outs])

        primal.defjvp(jvp)
        return primal(*invals)

    def _custom_vjp(self, eqn, invals, scope):
        """Autocast primal; the fwd/bwd rules run as written on values cast to their traced dtypes."""
        call = eqn.params["call_jaxpr"]
        dtypes, out_dtypes = _avals_dtypes(eqn.invars), _avals_dtypes(eqn.outvars)
        in_dtypes = [_dtype(x) for x in invals]
        original = functools.partial(_bind_original, eqn)
        primal = jax.custom_vjp(lambda *xs: self.eval_closed(call, xs, scope))

        def fwd(*xs):
            _, vjp_fn = jax.vjp(original, *_cast_all(xs, dtypes))
            return primal(*xs), vjp_fn

        def bwd(vjp_fn, cts):
            return tuple(_cast_all(vjp_fn(_cast_all(list(cts), out_dtypes)), in_dtypes))

        primal.defvjp(fwd, bwd)
        return primal(*invals)


_LOOKED_INTO = frozenset({"jit", "pjit", "closed_call", "core_call", "call"})  # for parameters' reads

_STRUCTURED = {
    "jit": Interpreter._inline,
    "pjit": Interpreter._inline,
    "closed_call": Interpreter._inline,
    "core_call": Interpreter._inline,
    "call": Interpreter._inline,
    "remat2": Interpreter._remat,
    "checkpoint": Interpreter._remat,
    "scan": Interpreter._scan,
    "while": Interpreter._while,
    "cond": Interpreter._cond,
    "custom_jvp_call": Interpreter._custom_jvp,
    "custom_vjp_call": Interpreter._custom_vjp,
}


def _bind_original(eqn, *invals) -> list:
    """``eqn`` bound on its inputs cast back to the dtypes they had in the traced function."""
    return _bind(eqn, _cast_all(invals, _avals_dtypes(eqn.invars)), eqn.params)


def _bind(eqn, invals, params) -> list:
    """Bind ``eqn``'s primitive as ``core.eval_jaxpr`` does; always a list of outputs."""
    bind_params = eqn.primitive.get_bind_params(params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def check_arguments(fn, rules) -> None:
    """PolyampError unless ``fn`` is callable and ``rules`` an AutocastRules."""
    if not callable(fn):
        raise PolyampError(f"autocast expects a function to rewrite, got {type(fn).__name__} {fn!r}; "
                           "pass the loss or model function itself: mp.autocast(loss_fn)")  # fmt: skip
    if not isinstance(rules, AutocastRules):
        raise PolyampError(f"rules must be an AutocastRules (e.g. DEFAULT_RULES.extend(...)), got "
                           f"{type(rules).__name__}")  # fmt: skip


def autocast(fn, compute: str, output: str, rules: AutocastRules = DEFAULT_RULES,
             keep_fp32: tuple[str, ...] = (), training_recipe=None, on_record=None):  # fmt: skip
    """``fn`` rewritten so each primitive runs under ``rules`` (see the module docstring), the
    equations under the ``keep_fp32`` layers in float32, dense matmuls as ``training_recipe`` says;
    ``on_record(RecipeLayers)`` is called at each trace under a recipe, which warns when it quantizes
    no layer.

    The result traces ``fn`` with ``jax.make_jaxpr`` on every call (inside ``jit`` that is once
    per compilation), evaluates the jaxpr with the rules, and casts each output back to the dtype
    ``fn`` returns, so a float32 loss stays float32. Argument leaves that are not arrays (an Equinox
    module's ``jax.nn.relu``) are passed to ``fn`` as they are; NNX and Equinox modules among the
    arguments are named by their paths (``modules.py``).
    """
    check_arguments(fn, rules)
    interpreter = Interpreter(compute, output, rules, keep_fp32, training_recipe)

    @functools.wraps(fn)
    def autocast_fn(*args, **kwargs):
        tree = (args, kwargs)
        leaves, treedef = jax.tree.flatten(tree)
        arrays = [is_array(x) for x in leaves]
        dynamic = [x for x, a in zip(leaves, arrays) if a]

        def flat_fn(*xs):
            it = iter(xs)
            a, k = jax.tree.unflatten(treedef, [next(it) if arr else x for x, arr in zip(leaves, arrays)])
            with module_scopes((a, k), skip=2):
                return fn(*a, **k)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic)
        names = [n for n, a in zip(leaf_names(tree, skip=2), arrays) if a]
        if training_recipe is not None:  # weights: a model's leaves, else every argument's
            inside = [m for m, a in zip(model_leaves(tree), arrays) if a]
            held = {v: n for v, n, m in zip(closed.jaxpr.invars, names, inside) if m or not any(inside)}
            weights = interpreter.weights = recipe.weight_names(closed.jaxpr, held)
            record, interpreter.recipe_kept = recipe.record(closed.jaxpr, training_recipe, weights)
            if on_record is not None:
                on_record(record)
            record.warn_if_none("JAX", "mp.autocast")
        if keep_fp32:  # each leaf named within its argument, as the doctor names params
            interpreter.leaves = {id(x): name for x, name in zip(dynamic, names) if name}
            interpreter.read_outside = {}
        try:
            outs = interpreter.eval_closed(closed, dynamic)
        finally:
            interpreter.leaves = {}
        if keep_fp32:
            layers = [*dict.fromkeys(scope_paths(closed.jaxpr)), *interpreter.read_outside]
            unmatched_layers(tuple(keep_fp32), layers)
        outs = _cast_all(outs, [a.dtype for a in closed.out_avals])
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return autocast_fn


__all__ = ["CLASSES", "DEFAULT_RULES", "AutocastRules", "Interpreter", "autocast", "check_arguments"]
