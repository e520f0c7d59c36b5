"""polyamp's JAX front end: op-level autocast of a function (``autocast.py``) and functional loss scaling.

    f = mp.autocast(loss_fn)                      # matmuls bf16 in / f32 accumulate, reductions f32
    state = mp.init()                             # mp.state as a pytree of arrays
    (loss, grads), finite, state = mp.value_and_grad(f)(params, batch, state=state)
    params, opt_state = step_if_finite(finite, optimizer, grads, opt_state, params)

``mp.grad(fn, argnums=0, has_aux=False, axis_name=None)(*args, state=state)`` returns
``(grads, finite, new_state)`` (``((grads, aux), ...)`` with ``has_aux=True``);
``mp.value_and_grad`` returns ``((value, grads), finite, new_state)`` (``value`` is
``(loss, aux)`` with ``has_aux``); a differentiated argument may be a whole Equinox or NNX module: as
``eqx.filter_value_and_grad`` does, only its floating array leaves are differentiated and the others
pass through, their grads None. The loss is multiplied by ``state.scale`` in float32
before differentiation and the grads are multiplied by ``1/scale`` after, so they are unscaled;
``finite`` is one fused all-finite reduction over every floating gradient (all-reduced with
``lax.pmin`` over ``axis_name`` inside ``shard_map``/``pmap``); ``new_state`` is the
loss-scale update of ``scaling.py`` written with selects. Nothing syncs with the host, so the
whole step stays in one ``jit``. ``mp.sync(state)`` brings a state back to ``mp.state`` (for
``mp.state_dict()``, ``mp.current_scale`` and the too-many-skips check). A jitted step cannot
raise, so ``NonFiniteError`` and the warning at the first skip of a bf16/float32 run come only
from ``mp.sync``: call it every few hundred steps (one small device-to-host copy).

Training recipes (``MixedPrecision("fp8-delayed")``, ``"nvfp4"``, ...): ``mp.autocast(loss_fn)``
quantizes the dense matmuls (``recipe.py``). A recipe that keeps state between steps (delayed scaling's
amax histories, stochastic rounding's call counter; ``recipe_state.py``) keeps it in the same ``state``:
``mp.init()`` returns a ``RecipeStepState``, the loss-scale fields plus ``recipe`` (a pytree), and
``mp.value_and_grad`` / ``mp.grad`` return it updated, so the step above is unchanged. Its gradients
come only from ``mp.value_and_grad`` (once per step; called elsewhere, the autocast function evaluates
without state: current scaling, nearest rounding); the delayed entries are created by
``mp.init(f, params, batch)`` or by the first step (a jitted step then traces again). ``mp.sync(state)``
brings the recipe's state to the host too, and ``mp.state_dict()`` / ``load_state_dict`` save and
restore it (``"recipe": {"name", "state"}``, torch's form), ``mp.init()`` resuming from it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..errors import PolyampError, UnsupportedError
from ..mixed_precision import MixedPrecision as _Base
from ..mixed_precision import WrongIdiomError
from ..scaling import COUNTERS, LossScaleState, NoLossScale
from . import autocast as _autocast
from . import recipe_state as _recipe_state
from .autocast import DEFAULT_RULES, AutocastRules, check_arguments
from .low_optim import low_precision
from .nnx import update_if_finite
from .recipe_state import RecipeState, keeps_state
from .tree import all_finite, cast_tree, eval_shape, is_array, select_tree, split_static, step_if_finite
from .weight_only import LowWeight, dequantize_weights, quantize_weights

# the loss-scale state is a pytree here: the scale and the counters are leaves (next_scale, only
# used by MXNet's one-step lag, is static)
jax.tree_util.register_dataclass(LossScaleState, data_fields=["scale", *COUNTERS], meta_fields=["next_scale"])


@dataclass(frozen=True)
class RecipeStepState(LossScaleState):
    """``mp.init()``'s state under a recipe that keeps state: the loss-scale state's fields, and
    ``recipe``, the recipe's :class:`~polyamp.jax.recipe_state.RecipeState`."""

    recipe: RecipeState | None = None


jax.tree_util.register_dataclass(RecipeStepState, data_fields=["scale", *COUNTERS, "recipe"],
                                 meta_fields=["next_scale"])  # fmt: skip


class MixedPrecision(_Base):
    """Mixed precision for one JAX training run (see ``polyamp.MixedPrecision``): functional,
    the loss-scale state passed in and out of the jitted step."""

    framework = "jax"
    takes_training_state = True

    def autocast(self, fn=None, *, enabled: bool = True, rules: AutocastRules | None = None):
        """``fn`` rewritten so its matmuls and convolutions run in the compute dtype (float32
        accumulation), reductions and exp/log in float32; ``rules`` is an ``AutocastRules`` table.
        The equations of the layers that ``mp.keep_fp32`` names (``jax.named_scope`` paths; the module
        paths of NNX and Equinox modules among ``fn``'s arguments, ``blocks.0.attn``) run as traced, in
        float32; a name that matches no layer of ``fn`` raises when ``fn`` is traced. Under a recipe,
        each trace sets ``mp.recipe_layers``."""
        if fn is None:
            rules_arg = ", rules=rules" if rules is not None else ""
            raise PolyampError(f"JAX has no autocast context; mp.autocast rewrites a function: "
                               f"f = mp.autocast(loss_fn{rules_arg})")  # fmt: skip
        rules = DEFAULT_RULES if rules is None else rules
        check_arguments(fn, rules)
        policy = self.policy
        if policy.compute_dtype == "float64" or policy.param_dtype == "float64":
            if not jax.config.jax_enable_x64:
                raise UnsupportedError(
                    f"policy {policy.name!r} needs float64, which JAX disables by default; set "
                    "jax.config.update('jax_enable_x64', True) first, or use float32/bf16-mixed/fp16-mixed"
                )
        if not enabled or (self.recipe is None and policy.compute_dtype not in ("bfloat16", "float16")):
            return fn
        if policy.compute_dtype != "float32":
            _check_device_supports(policy.compute_dtype)
        return _autocast.autocast(fn, policy.compute_dtype, policy.output_dtype, rules, self.keep_fp32,
                                  self.recipe, self._set_recipe_layers)  # fmt: skip

    def _set_recipe_layers(self, record) -> None:
        self._recipe_layers = record

    def __getattr__(self, name: str):
        if name in ("backward", "step", "apply"):  # the eager and Keras steps
            raise _functional(f"mp.{name}")
        return super().__getattr__(name)

    def _setup(self) -> None:
        super()._setup()
        self._recipe_host = None  # the recipe's state on the host (recipe_state.to_host), from sync / load

    def optimizer(self, tx: Any, seed: int = 0) -> Any:
        """The optax transformation ``tx`` as the policy's training-state options want it:
        ``polyamp.jax.low_precision(tx, ...)`` for ``bf16-true:sr`` / ``:kahan`` / ``states=...``, else
        ``tx``."""
        options = self.policy.state
        if options is None or not options.trains:
            return tx
        from .low_optim import low_precision

        return low_precision(tx, options.update, options.states, seed)

    def init(self, fn=None, *args, **kwargs) -> LossScaleState:
        """``mp.state`` with 0-d arrays as fields (float32 scale, int32 counters): the pytree to
        thread through a jitted train step; under a recipe that keeps state (``fp8-delayed``,
        stochastic rounding) a ``RecipeStepState``, whose ``recipe`` field holds that state too.
        ``mp.init(f, *args, **kwargs)``, with the autocast loss function and example arguments, also
        creates the delayed-scaling entries of ``f``'s matmuls (traced abstractly), so the state's
        structure is final from the first step (for ``jit(...).lower(...)`` or a ``lax.scan`` of steps)."""
        self.loss_scale.check_traceable("jit")
        host = self.state
        fields = {"scale": jnp.asarray(host.scale, jnp.float32),
                  **{k: jnp.asarray(getattr(host, k), jnp.int32) for k in COUNTERS}}  # fmt: skip
        if not keeps_state(self.recipe):
            return LossScaleState(**fields)
        rs = _recipe_state.from_host(self._recipe_host)
        if fn is not None and self.recipe.kind == "delayed":
            run = _recipe_state.Run(self.recipe, rs.calls, {k: e["scale"] for k, e in rs.delayed.items()})
            with _recipe_state.running(run):
                eval_shape(fn, *args, **kwargs)
            rs = _recipe_state.fill(self.recipe, rs, run.missing)
        return RecipeStepState(**fields, recipe=rs)

    def update(self, state: LossScaleState, finite) -> LossScaleState:
        """The state after a step whose gradients were ``finite`` (a 0-d bool array) or not:
        the loss-scale rule on arrays, so it runs inside ``jit`` (``value_and_grad`` calls it); a
        ``RecipeStepState``'s recipe state is kept as it is."""
        _check_state(state)
        fields = {k: getattr(state, k) for k in ("scale", *COUNTERS)}
        fields = self.loss_scale.update_arrays(fields, finite, jnp)
        if isinstance(state, RecipeStepState):
            return RecipeStepState(**fields, recipe=state.recipe)
        return LossScaleState(**fields)

    def sync(self, state: LossScaleState) -> LossScaleState:
        """Adopt a state from ``init``/``grad`` as ``mp.state`` (one small device-to-host copy),
        so that ``state_dict()`` and ``current_scale`` reflect it; warns at the first skipped step
        of a run without loss scaling and raises ``NonFiniteError`` after too many in a row."""
        _check_state(state)
        before = self.state.skipped
        if isinstance(state, RecipeStepState) and self.recipe is not None:
            self._recipe_host = _recipe_state.to_host(self.recipe, state.recipe)
        self.state = jax.device_get(state).on_host()
        self.loss_scale.check(self.state, skipped_before=before)
        return self.state

    def _recipe_state(self) -> dict:
        """The recipe's state as of the last ``mp.sync``, in torch's form (``mp.init()`` starts from a
        loaded one)."""
        return _recipe_state.host_state_dict(self._recipe_host)

    def _recipe_loader(self, state):
        host = _recipe_state.load_host(self.recipe, state)
        return lambda: setattr(self, "_recipe_host", host)

    def grad(self, fn, **kwargs):
        """Like ``jax.grad`` of a scalar loss: ``f(*args, state=state)`` returns
        ``(grads, finite, new_state)`` (``((grads, aux), ...)`` with ``has_aux=True``)."""
        value_and_grad = self.value_and_grad(fn, **kwargs)
        has_aux = kwargs.get("has_aux", False)

        @functools.wraps(fn)
        def grad_fn(*args, **kw):
            (value, grads), finite, state = value_and_grad(*args, **kw)
            return ((grads, value[1]) if has_aux else grads), finite, state

        return grad_fn

    def value_and_grad(self, fn, *, argnums=0, has_aux: bool = False, axis_name=None):
        """Like ``jax.value_and_grad``: ``f(*args, state=state)`` returns
        ``((value, grads), finite, new_state)``."""
        if not callable(fn):
            raise PolyampError(f"value_and_grad expects the loss function, got {type(fn).__name__}")
        guard, policy = self.guard, self.policy
        scaling = not isinstance(self.loss_scale, NoLossScale)

        stateful = keeps_state(self.recipe)

        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

        @functools.wraps(fn)
        def value_and_grad_fn(*args, state=None, **kwargs):
            _check_state(state)
            _check_param_dtypes(args, argnums, policy)
            args, restore = split_static(args, nums)  # a whole module: its other leaves pass through
            if stateful:
                return self._recipe_step(fn, argnums, has_aux, axis_name, args, kwargs, state, restore)

            def scaled(*a, **k):
                out = fn(*restore(a), **k)
                loss, aux = out if has_aux else (out, None)
                _check_loss(loss)
                big = loss.astype(jnp.float32) * state.scale if scaling else loss
                return big, (loss, aux)

            (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)(
                *args, **kwargs
            )
            if scaling:
                inv = 1.0 / state.scale
                grads = jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)
            finite = all_finite(grads) if guard else jnp.asarray(True)
            if axis_name is not None:
                finite = lax.pmin(finite.astype(jnp.int32), axis_name) == 1
            value = (loss, aux) if has_aux else loss
            return (value, grads), finite, self.update(state, finite)

        return value_and_grad_fn

    def _recipe_step(self, fn, argnums, has_aux, axis_name, args, kwargs, state, restore):
        """``value_and_grad`` under a recipe that keeps state (``recipe_state.py``): the gradient is
        also taken with respect to the delayed scales, which yields the step's amaxes."""
        if not isinstance(state, RecipeStepState) or not isinstance(state.recipe, RecipeState):
            raise PolyampError(f"the {self.recipe.name!r} recipe keeps state between steps: pass the state "
                               f"from mp.init() (a RecipeStepState), got {type(state).__name__}")  # fmt: skip
        scaling = not isinstance(self.loss_scale, NoLossScale)
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

        def attempt(rs):
            run = _recipe_state.Run(self.recipe, rs.calls, {k: e["scale"] for k, e in rs.delayed.items()})

            def scaled(scales, *a, **k):
                run.scales = scales
                with _recipe_state.running(run):
                    out = fn(*restore(a), **k)
                loss, aux = out if has_aux else (out, None)
                _check_loss(loss)
                big = loss.astype(jnp.float32) * state.scale if scaling else loss
                return big, (loss, aux)

            diff = jax.value_and_grad(scaled, argnums=(0, *(i + 1 for i in nums)), has_aux=True)
            (_, value), (amaxes, *grads) = diff(run.scales, *args, **kwargs)
            return run, value, amaxes, grads

        rs = state.recipe
        run, value, amaxes, grads = attempt(rs)
        if run.missing:  # entries met for the first time: trace again with them in the state
            rs = _recipe_state.fill(self.recipe, rs, run.missing)
            run, value, amaxes, grads = attempt(rs)
        grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        if scaling:
            inv = 1.0 / state.scale
            grads = jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)
        finite = all_finite(grads) if self.guard else jnp.asarray(True)
        if axis_name is not None:
            finite = lax.pmin(finite.astype(jnp.int32), axis_name) == 1
        new = self.update(state, finite)
        rs = _recipe_state.advance(self.recipe, rs, run, amaxes, axis_name)
        loss, aux = value
        return ((loss, aux) if has_aux else loss, grads), finite, replace(new, recipe=rs)


def _functional(call: str) -> WrongIdiomError:
    return WrongIdiomError(
        f"JAX is functional: instead of {call}, use (loss, grads), finite, state = "
        "mp.value_and_grad(loss_fn)(params, batch, state=state) and polyamp.jax."
        "step_if_finite(finite, optimizer, grads, opt_state, params)"
    )


def _check_state(state) -> None:
    if not isinstance(state, LossScaleState):
        raise PolyampError(
            f"expected the loss-scale state from mp.init() as state=..., got {type(state).__name__}; "
            "call f(params, batch, state=state) with state = mp.init() before the loop"
        )


def _check_param_dtypes(args, argnums, policy) -> None:
    """Under a "true" policy the differentiated arguments must hold the low dtype (checked at trace
    time, so it costs nothing under ``jit``)."""
    if policy.param_dtype == "float32":
        return
    for i in (argnums,) if isinstance(argnums, int) else argnums:
        for leaf in jax.tree.leaves(args[i] if i < len(args) else ()):
            if not is_array(leaf):
                continue
            dtype = jnp.result_type(leaf)
            if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.dtype(policy.param_dtype):
                raise PolyampError(
                    f"policy {policy.name!r} keeps parameters in {policy.param_dtype}, but argument {i} "
                    f"holds a {jnp.shape(leaf)} {dtype} leaf: cast them once, params = "
                    f"polyamp.jax.cast_tree(params, {policy.param_dtype!r})"
                )


def _check_loss(loss) -> None:
    dtype = getattr(loss, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or jnp.shape(loss) != ():
        shape = jnp.shape(loss) if dtype is not None else type(loss).__name__
        raise PolyampError(f"the loss function must return a floating scalar (or (loss, aux) with "
                           f"has_aux=True), got {dtype} {shape}")  # fmt: skip


def _check_device_supports(dtype: str) -> None:
    """Compile and run a ``dtype`` matmul accumulating in float32 on the default device, once."""
    _probe(dtype, jax.default_backend())


@functools.cache
def _probe(dtype: str, backend: str) -> None:
    try:
        with jax.ensure_compile_time_eval():  # autocast may be first called inside a jit trace
            a = jnp.ones((8, 8), dtype)
            out = jax.jit(lambda x: lax.dot(x, x, preferred_element_type=jnp.float32))(a)
            ok = bool(jnp.all(out == 8.0))
    except Exception as err:  # the XLA error text names what the device lacks
        raise UnsupportedError(f"JAX cannot run {dtype} matmuls on {backend} here: {err}") from err
    if not ok:
        raise UnsupportedError(f"JAX computed a wrong {dtype} matmul on {backend}: use another policy")


__all__ = ["DEFAULT_RULES", "AutocastRules", "MixedPrecision", "RecipeState", "RecipeStepState", "all_finite",
           "LowWeight", "dequantize_weights", "low_precision", "quantize_weights",
           "cast_tree", "select_tree", "step_if_finite", "update_if_finite"]  # fmt: skip
