"""The TensorFlow step: unscale, check, agree across replicas, clip, apply or skip, update.

``mp.apply(optimizer, grads, variables)`` and the ``fit`` path (``fit.py``) share ``run_step``:
unscale the gradients, check them (``_all_finite``: one sum per gradient, read in bfloat16 where
the backward pass made it so; an exact per-element check only if that sum is not finite), agree
across replicas, then in a cross-replica ``merge_call``: clip by the global norm of the summed
gradients (optional), apply or skip (``tf.cond``), update the scale with the one rule of
``scaling.py`` (``update_arrays`` on TF ops) and guard against endless skipping. The state lives
in ``LossScaleVariables``, so the same step runs eagerly and inside ``tf.function``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import replace

import keras
import numpy as np
import tensorflow as tf

from ..errors import PolyampError
from ..scaling import (
    BELOW_ONE_WARNING,
    COUNTERS,
    LossScaleState,
    NoLossScale,
    state_arrays,
    state_from_arrays,
)
from ..step import StepResult

_FIELDS = ("scale", *COUNTERS)


class _Numpy:
    """The array namespace ``update_arrays`` needs, as TF ops (keeps int32 counters int32)."""

    float32, int32 = tf.float32, tf.int32
    minimum, maximum, abs, zeros_like = tf.minimum, tf.maximum, tf.abs, tf.zeros_like
    isfinite = staticmethod(tf.math.is_finite)

    @staticmethod
    def asarray(value, dtype=None):
        return tf.convert_to_tensor(value, dtype=dtype)

    @staticmethod
    def where(cond, x, y):
        dtype = next((v.dtype for v in (x, y) if tf.is_tensor(v)), tf.int32)
        return tf.where(cond, tf.cast(x, dtype), tf.cast(y, dtype))


class LossScaleVariables(tf.Module):
    """The loss-scale state as tf.Variables: ``mp``'s state store, tracked by checkpoints."""

    def __init__(self, state: LossScaleState):
        super().__init__(name="polyamp_loss_scale")
        for name, value in state_arrays(state, np).items():
            setattr(self, name, tf.Variable(value, trainable=False, name=name))

    def arrays(self) -> dict:
        return {name: getattr(self, name).read_value() for name in _FIELDS}

    def assign(self, arrays: dict) -> None:
        for name in _FIELDS:
            getattr(self, name).assign(arrays[name])

    def read(self) -> LossScaleState:
        return state_from_arrays({name: getattr(self, name).numpy() for name in _FIELDS})

    def write(self, state: LossScaleState) -> None:
        with tf.init_scope():
            self.assign(state_arrays(state, np))


def attach(optimizer, store: LossScaleVariables) -> None:
    """Track the state on the Keras optimizer, so tf.train.Checkpoint(optimizer=...) holds it."""
    current = getattr(optimizer, "_polyamp_loss_scale", None)
    if current is None:
        with tf.init_scope():
            optimizer._polyamp_loss_scale = store
    elif current is not store:
        raise PolyampError(
            f"this {type(optimizer).__name__} is already driven by another MixedPrecision; use one "
            "MixedPrecision per optimizer"
        )


# -- the step --------------------------------------------------------------------------------------
def run_step(mp, optimizer, grads: list, variables: list, clip: float | None):
    """Unscale and check per replica, then decide, apply or skip and update once (merge_call).

    A variable with ``overwrite_with_gradient`` takes its gradient as its new value: that value is
    checked but neither unscaled nor clipped, as Keras's LossScaleOptimizer does.
    """
    store = mp.loss_scale_variables()
    if not optimizer.built:  # its variables must not be created inside tf.cond
        if tf.distribute.has_strategy() and not tf.executing_eagerly():
            raise PolyampError(
                f"build the {type(optimizer).__name__} before the first tf.function step under a "
                "distribution strategy (TensorFlow cannot initialise mirrored variables created "
                "inside it): with strategy.scope(): optimizer.build(model.trainable_variables)"
            )
        optimizer.build(variables)
    context = tf.distribute.get_replica_context()
    if context is None:
        raise PolyampError(
            "mp.apply ran in a cross-replica context; call it inside strategy.run(...), where "
            "each replica has its own gradients"
        )
    overwrite = [getattr(v, "overwrite_with_gradient", False) for v in variables]
    unscaled, scale = grads, None
    if not isinstance(mp.loss_scale, NoLossScale):
        scale = store.scale.read_value()
        unscaled = [g if keep else _map(g, lambda v: v / tf.cast(scale, v.dtype))
                    for g, keep in zip(grads, overwrite)]  # fmt: skip
    bad = tf.cast(~_all_finite(unscaled, grads, scale), tf.float32) if mp.guard else None
    merged = functools.partial(_merged_step, mp=mp, optimizer=optimizer, variables=variables,
                               overwrite=overwrite, clip=clip)  # fmt: skip
    result, names = context.merge_call(merged, args=(unscaled, bad))
    if not names:  # stepped, or inside tf.function
        return result
    mine = names[int(tf.get_static_value(context.replica_id_in_sync_group))]
    if mine or not result.nonfinite_ranks:
        return replace(result, nonfinite=mine)
    return replace(result, origin=_other_replicas(result.nonfinite_ranks, names))


def _merged_step(strategy, unscaled, bad, *, mp, optimizer, variables, overwrite, clip):
    """Cross-replica part of the step: ``(StepResult, names)``, where eagerly after a skip
    ``names[r]`` holds the variables whose gradients were not finite on replica ``r``."""
    eager = tf.executing_eagerly()
    finite = True if bad is None else tf.equal(strategy.reduce("SUM", bad, axis=None), 0.0)
    norm = None
    coef = None
    if clip is not None:
        summed = [strategy.reduce("SUM", g, axis=None) for g, keep in zip(unscaled, overwrite)
                  if g is not None and not keep]  # fmt: skip
        norm = tf.linalg.global_norm(summed)
        coef = tf.minimum(1.0, clip / (norm + 1e-6))

    def apply_local(grads):
        if coef is not None:
            grads = [g if keep else _map(g, lambda v: v * tf.cast(coef, v.dtype))
                     for g, keep in zip(grads, overwrite)]  # fmt: skip
        optimizer.apply(grads, variables)

    def apply():
        strategy.extended.call_for_each_replica(apply_local, args=(unscaled,))

    stepped = finite is True or (eager and bool(finite))  # one host read of the flag, eagerly
    if stepped:
        apply()
    elif not eager:
        tf.cond(finite, apply, lambda: None)
    store = mp.loss_scale_variables()
    old = store.arrays()
    new = mp.loss_scale.update_arrays(old, tf.convert_to_tensor(finite), _Numpy)
    store.assign(new)
    limit = mp.loss_scale.max_consecutive_skips
    if not eager:
        if limit is not None:
            tf.debugging.Assert(new["skipped_in_a_row"] < limit, [_GUARD.format(limit=limit), new["scale"]])
        return StepResult(tf.convert_to_tensor(finite), new["scale"], norm), ()
    state = state_from_arrays({name: value.numpy() for name, value in new.items()})
    if state.scale < 1 <= float(old["scale"]):
        warnings.warn(BELOW_ONE_WARNING, RuntimeWarning, stacklevel=2)
    names: tuple = ()
    ranks: tuple[int, ...] = ()
    if not stepped:
        flags = [float(flag) for flag in strategy.experimental_local_results(bad)]
        names = tuple(_nonfinite_names(mp, unscaled, variables, strategy, replica) if flag else ()
                      for replica, flag in enumerate(flags))  # fmt: skip
        ranks = tuple(replica for replica, flag in enumerate(flags) if flag) if len(flags) > 1 else ()
    every = tuple(dict.fromkeys(name for local in names for name in local))
    mp.loss_scale.check(state, nonfinite=every)
    grad_norm = float(norm) if norm is not None and stepped else None
    return StepResult(stepped, state.scale, grad_norm, nonfinite_ranks=ranks), names


def _other_replicas(ranks: tuple[int, ...], names: tuple) -> str:
    """``origin`` on a replica whose own gradients were finite: which replicas' were not."""
    which = ", ".join(f"{r} ({', '.join(names[r])})" if names[r] else str(r) for r in ranks)
    return f"the gradients of replica{'s' if len(ranks) > 1 else ''} {which}"


_GUARD = (
    "polyamp NonFiniteError: {limit} consecutive steps were skipped because the gradients were not "
    "finite (max_consecutive_skips={limit}); training is not progressing. Run the step eagerly to "
    "learn which gradient was first non-finite. Loss scale:"
)


# -- helpers ---------------------------------------------------------------------------------------
def _map(g, fn):
    """``fn`` applied to a dense gradient or to an IndexedSlices' values; None stays None."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)


def _values(g):
    return g.values if isinstance(g, tf.IndexedSlices) else g


# casts from bfloat16 widen exactly (the output is finite exactly where the input is), and a
# bfloat16 sum has float32's range; a float16 sum overflows at 65504, so float16 is not read
_WIDENING = {(tf.bfloat16, tf.float32), (tf.bfloat16, tf.float64)}


def _produced_by(g: tf.Tensor) -> tf.Tensor:
    """In a traced step, the bfloat16 tensor that ``g`` is an exact widening ``Cast`` of, else ``g``.

    Under ``mixed_bfloat16`` the backward pass computes a float32 variable's gradient in bfloat16
    and casts it up; the bfloat16 tensor holds the same values in half the bytes.
    """
    if tf.executing_eagerly() or not hasattr(g, "op"):
        return g
    op = g.op
    if op.type == "Cast" and (op.inputs[0].dtype, g.dtype) in _WIDENING:
        return op.inputs[0]
    return g


def _all_finite(applied, raw, scale=None) -> tf.Tensor:
    """Whether every gradient as applied (``applied``: ``raw`` unscaled, or ``raw`` itself) is finite.

    Quick test, a pass the step does not otherwise make: one sum per raw gradient, read where the
    backward pass produced it (``_produced_by``; a sum is finite only if every term is). It stands
    for the applied gradients when there is no scale or ``scale >= 1``: ``raw / scale`` is then
    finite exactly where ``raw`` is. Only where it fails (a non-finite value, a finite sum that
    overflowed, or a scale below 1) does an exact element-wise check of ``applied`` decide.
    """
    present = [_values(g) for g in applied if g is not None]
    sums = [tf.cast(tf.reduce_sum(_produced_by(_values(g))), tf.float32) for g in raw if g is not None]
    quick = tf.math.is_finite(tf.add_n(sums)) if sums else tf.constant(True)
    if scale is not None:
        quick = quick & (scale >= 1.0)

    def exact():
        return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in present]))

    if tf.executing_eagerly():
        return quick if bool(quick) else exact()
    return tf.cond(quick, lambda: tf.constant(True), exact)


def _nonfinite_names(mp, unscaled, variables, strategy, replica: int) -> tuple[str, ...]:
    """Eagerly: the variables whose gradient held inf/NaN on ``replica``."""
    names = []
    for g, v in zip(unscaled, variables):
        local = None if g is None else strategy.experimental_local_results(g)[replica]
        if local is not None and not bool(tf.reduce_all(tf.math.is_finite(_values(local)))):
            names.append(mp.parameter_name(v))
    return tuple(names)


def variable_name(v) -> str:
    name = getattr(v, "path", None) or v.name
    return name[:-2] if name.endswith(":0") else name


def check_optimizer(optimizer) -> None:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # PolyampOptimizer too
        raise PolyampError(
            f"got a {type(optimizer).__name__}, which already scales the loss; pass the optimizer "
            "it wraps (its inner_optimizer): polyamp does the loss scaling (Keras's own schedule "
            "is loss_scale='keras')"
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise PolyampError(
            f"expected a Keras 3 optimizer (keras.optimizers.Adam, SGD, ...), got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        )


def check_pairs(grads, variables) -> tuple[list, list]:
    if not isinstance(grads, Sequence) or not isinstance(variables, Sequence):
        raise PolyampError(
            "mp.apply(optimizer, grads, variables) takes two lists of equal length, got "
            f"{type(grads).__name__} and {type(variables).__name__}"
        )
    grads, variables = list(grads), list(variables)
    if len(grads) != len(variables) or not grads:
        raise PolyampError(
            f"mp.apply got {len(grads)} gradients for {len(variables)} variables; pass one gradient "
            "(or None) per variable, e.g. tape.gradient(scaled_loss, model.trainable_variables)"
        )
    for i, g in enumerate(grads):
        if g is not None and not (tf.is_tensor(g) or isinstance(g, tf.IndexedSlices)):
            raise PolyampError(
                f"grads[{i}] is a {type(g).__module__}.{type(g).__name__}; mp.apply takes "
                "TensorFlow gradients (tf.Tensor, tf.IndexedSlices or None)"
            )
    for i, v in enumerate(variables):
        if not isinstance(v, (keras.Variable, tf.Variable)):
            raise PolyampError(
                f"variables[{i}] is a {type(v).__module__}.{type(v).__name__}; mp.apply takes "
                "Keras or TensorFlow variables"
            )
    if all(g is None for g in grads):
        raise PolyampError(
            "every gradient is None: did the loss depend on these variables? (call mp.scale(loss) inside "
            "the `with tf.GradientTape()` block: the tape records only what runs there)"
        )
    return grads, variables
