"""JAX backend: op-level autocast of a function (``jax_autocast.py``) and functional loss scaling.

    f = mp.autocast(loss_fn)                      # matmuls bf16 in / f32 accumulate, reductions f32
    state = mp.init()                             # ScaleState pytree (mp.state, as arrays)
    (loss, grads), finite, state = mp.value_and_grad(f)(params, batch, state=state)
    params, opt_state = step_if_finite(finite, optimizer, grads, opt_state, params)

``mp.grad(fn, argnums=0, has_aux=False, axis_name=None)(*args, state=state)`` returns
``(grads, finite, new_state)`` (``((grads, aux), ...)`` with ``has_aux=True``);
``mp.value_and_grad`` returns ``((value, grads), finite, new_state)`` (``value`` is
``(loss, aux)`` with ``has_aux``). The loss is multiplied by ``state.scale`` in float32
before differentiation and the grads are multiplied by ``1/scale`` after, so they are unscaled;
``finite`` is one fused all-finite reduction over every floating gradient (all-reduced with
``lax.pmin`` over ``axis_name`` inside ``shard_map``/``pmap``); ``new_state`` is the
loss-scale update of ``scaling.py`` written with selects. Nothing syncs with the host, so the
whole step stays in one ``jit``. ``mp.sync(state)`` brings a state back to ``mp.state`` (for
``mp.state_dict()``, ``mp.current_scale`` and the too-many-skips check). A jitted step cannot
raise, so ``NonFiniteError`` and the warning at the first skip of a bf16/float32 run come only
from ``mp.sync``: call it every few hundred steps (one small device-to-host copy).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..errors import PolyampError, UnsupportedError
from ..scaling import COUNTERS, LossScaleState, NoLossScale, state_arrays, state_from_arrays
from ._base import Backend
from .jax_autocast import DEFAULT_RULES, AutocastRules, autocast, check_arguments


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["scale", *COUNTERS], meta_fields=["config"])  # fmt: skip
@dataclass(frozen=True)
class ScaleState:
    """The loss-scale state as a pytree: float32 ``scale`` and int32 counters are leaves; the
    loss-scale config (frozen, hashable) is static, so no field is lost under ``jit``,
    ``tree_map`` or pickling."""

    scale: Any
    good_steps: Any
    hysteresis_left: Any
    skipped_in_a_row: Any
    steps: Any
    skipped: Any
    config: Any

    @classmethod
    def from_state(cls, config, state: LossScaleState) -> ScaleState:
        return cls(**state_arrays(state, jnp), config=config)

    def arrays(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}

    def to_state(self) -> LossScaleState:
        """The host-side ``LossScaleState`` (one device-to-host transfer)."""
        return state_from_arrays(jax.device_get(self.arrays()))

    def update(self, finite) -> ScaleState:
        return ScaleState(**self.config.update_arrays(self.arrays(), finite, jnp), config=self.config)


def select_tree(pred, on_true, on_false):
    """``on_true`` where the 0-d bool ``pred`` holds, else ``on_false``, leaf by leaf (no branch)."""
    if jnp.shape(pred) != () or jnp.result_type(pred) != jnp.bool_:
        raise PolyampError(
            f"select_tree needs a 0-d bool predicate (e.g. the finite flag); received dtype "
            f"{jnp.result_type(pred)} and shape {jnp.shape(pred)}"
        )
    if jax.tree.structure(on_true) != jax.tree.structure(on_false):
        raise PolyampError(
            f"select_tree needs two trees of one structure; received {jax.tree.structure(on_true)} "
            f"and {jax.tree.structure(on_false)}"
        )
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def cast_tree(tree, dtype: str):
    """``tree`` with every floating leaf cast to ``dtype`` (e.g. params for a "true" policy)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating)
                        else x, tree)  # fmt: skip


def step_if_finite(finite, optimizer, grads, opt_state, params):
    """Run an optax ``optimizer`` update only if ``finite``; ``(params, opt_state)`` either way.

    A ``lax.cond`` on the device, so the step stays in one ``jit`` (under ``vmap`` it becomes a
    select). With params and optimizer state donated to the step, XLA updates them in place under
    the ``cond``, where a select of the stepped and the old trees keeps both alive
    (``select_tree``; docs/BENCHMARKS.md compares the two). Named apart from optax's
    ``apply_if_finite``, a gradient transformation with another meaning.
    """
    import optax

    def step(operands):
        grads, opt_state, params = operands
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lax.cond(finite, step, lambda operands: (operands[2], operands[1]), (grads, opt_state, params))


def all_finite(tree):
    """One fused reduction: True when every floating leaf of ``tree`` is finite."""
    flags = [jnp.isfinite(g).all() for g in jax.tree.leaves(tree) if jnp.issubdtype(g.dtype, jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.asarray(True)


class JaxBackend(Backend):
    name = "jax"

    def autocast(self, policy, device):
        raise PolyampError("JAX has no autocast context; rewrite the function instead: "
                           "f = mp.autocast(loss_fn)")  # fmt: skip

    def gradients(self, optimizers):
        raise _functional("mp.step")

    def apply_gradients(self, mp, optimizer, grads, variables, clip_grad_norm):
        raise _functional("mp.apply")

    # -- autocast -----------------------------------------------------------------------------------
    def autocast_fn(self, mp, fn, enabled: bool = True, rules: AutocastRules | None = None):
        rules = DEFAULT_RULES if rules is None else rules
        check_arguments(fn, rules)
        policy = mp.policy
        if policy.compute_dtype == "float64" or policy.param_dtype == "float64":
            if not jax.config.jax_enable_x64:
                raise UnsupportedError(
                    f"policy {policy.name!r} needs float64, which JAX disables by default; set "
                    "jax.config.update('jax_enable_x64', True) first, or use float32/bf16-mixed/fp16-mixed"
                )
        if not (enabled and policy.compute_dtype in ("bfloat16", "float16")):
            return fn
        _check_device_supports(policy.compute_dtype)
        return autocast(fn, policy.compute_dtype, policy.output_dtype, rules)

    # -- functional loss scaling ------------------------------------------------------------------
    def init_state(self, mp) -> ScaleState:
        config = mp.loss_scale
        config.check_traceable("jit")
        try:
            hash(config)
        except TypeError as err:
            raise PolyampError(f"the loss-scale object {config!r} must be hashable (a frozen "
                               "dataclass) to be static data of a JAX pytree") from err  # fmt: skip
        return ScaleState.from_state(config, mp.state)

    def sync(self, mp, state) -> LossScaleState:
        _check_state(state)
        if state.config != mp.loss_scale:
            raise PolyampError(f"this state belongs to loss scale {state.config!r}, not to this "
                               f"MixedPrecision's {mp.loss_scale!r}")  # fmt: skip
        before = mp.state.skipped
        mp.state = state.to_state()
        mp.loss_scale.check(mp.state, skipped_before=before)
        return mp.state

    def grad(self, mp, fn, **kwargs):
        value_and_grad = self.value_and_grad(mp, fn, **kwargs)
        has_aux = kwargs.get("has_aux", False)

        @functools.wraps(fn)
        def grad_fn(*args, **kw):
            (value, grads), finite, state = value_and_grad(*args, **kw)
            return ((grads, value[1]) if has_aux else grads), finite, state

        return grad_fn

    def value_and_grad(self, mp, fn, *, argnums=0, has_aux: bool = False, axis_name=None):
        if not callable(fn):
            raise PolyampError(f"value_and_grad expects the loss function, got {type(fn).__name__}")
        guard, policy = mp.guard, mp.policy

        @functools.wraps(fn)
        def value_and_grad_fn(*args, state=None, **kwargs):
            _check_state(state)
            _check_param_dtypes(args, argnums, policy)
            scaling = not isinstance(state.config, NoLossScale)

            def scaled(*a, **k):
                out = fn(*a, **k)
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
            return (value, grads), finite, state.update(finite)

        return value_and_grad_fn


def _functional(call: str) -> PolyampError:
    return PolyampError(
        f"JAX is functional: instead of {call}, use (loss, grads), finite, state = "
        "mp.value_and_grad(loss_fn)(params, batch, state=state) and polyamp.backends.jax."
        "step_if_finite(finite, optimizer, grads, opt_state, params)"
    )


def _check_state(state) -> None:
    if not isinstance(state, ScaleState):
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
            dtype = jnp.result_type(leaf)
            if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.dtype(policy.param_dtype):
                raise PolyampError(
                    f"policy {policy.name!r} keeps parameters in {policy.param_dtype}, but argument {i} "
                    f"holds a {jnp.shape(leaf)} {dtype} leaf: cast them once, params = "
                    f"polyamp.backends.jax.cast_tree(params, {policy.param_dtype!r})"
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


BACKEND = JaxBackend()

__all__ = ["BACKEND", "DEFAULT_RULES", "AutocastRules", "ScaleState", "all_finite", "step_if_finite",
           "cast_tree", "select_tree"]  # fmt: skip
