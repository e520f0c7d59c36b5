"""``fit`` on Keras's JAX and torch backends: ``KerasOptimizer`` (``mp.optimizer``), written once over
``keras.ops``, and ``LossScaleLogger`` (``mp.callback()``).

The loss-scale state is six Keras variables of the optimizer (the float32 scale and the int32 counters
of ``LossScaleState``), so the JAX trainer threads them through its compiled step as it threads any
optimizer variable, a ``.keras`` file saves them, and ``mp.state`` reads them. A step:

1. ``finite``: every gradient finite (``overwrite_with_gradient`` values too, as Keras checks them);
2. the gradients divided by the scale (not the ``overwrite_with_gradient`` ones), the inner optimizer's
   update taken when ``finite`` and the variables kept otherwise (``ops.cond``);
3. the new state by the loss scale's one rule (``LossScale.update_arrays`` over ``keras.ops``).

On JAX that is ``stateless_apply`` inside the trainer's jitted step; on torch ``apply``, eagerly. The
skip guard (``max_consecutive_skips``) and the "scale fell below 1" warning run on the host: in
``apply`` after each step, and under JAX's ``fit`` in ``LossScaleLogger`` at each batch end.
"""

from __future__ import annotations

import warnings

import keras
from keras import ops
from keras.callbacks import Callback

from ..errors import PolyampError
from ..mixed_precision import MixedPrecision
from ..scaling import BELOW_ONE_WARNING, COUNTERS, NoLossScale, loss_scale_from_dict, state_from_arrays

FIELDS = ("scale", *COUNTERS)
_DTYPES = {"scale": "float32", **dict.fromkeys(COUNTERS, "int32")}


class _Ops:
    """The array namespace ``update_arrays`` needs, as ``keras.ops`` (int32 counters stay int32)."""

    float32, int32 = "float32", "int32"
    minimum, maximum, abs, zeros_like = ops.minimum, ops.maximum, ops.abs, ops.zeros_like
    isfinite = staticmethod(ops.isfinite)

    @staticmethod
    def asarray(value, dtype=None):
        return ops.convert_to_tensor(value, dtype=dtype)

    @staticmethod
    def where(cond, x, y):
        dtype = next((v.dtype for v in (x, y) if ops.is_tensor(v)), "int32")
        return ops.where(cond, ops.cast(x, dtype), ops.cast(y, dtype))


@keras.saving.register_keras_serializable(package="polyamp.keras")
class KerasOptimizer(keras.optimizers.LossScaleOptimizer):
    """A Keras optimizer for ``compile``/``fit`` that scales, checks and skips as polyamp does.

    It subclasses Keras's ``LossScaleOptimizer`` so that ``compile`` does not wrap it a second time
    under a ``mixed_float16`` policy; none of that class's scaling runs. ``initial_scale`` and
    ``dynamic_growth_steps`` describe polyamp's loss scale (None where it does not grow); the config adds
    ``mixed_precision`` (policy, loss-scale config, guard), from which ``from_config`` rebuilds the
    ``MixedPrecision``; the state itself is in the optimizer's variables, which a ``.keras`` file holds.
    """

    def __init__(self, mp, inner_optimizer, name=None):
        growth = getattr(mp.loss_scale, "growth_interval", None)
        initial = mp.loss_scale.init().scale
        super().__init__(inner_optimizer, initial_scale=initial, dynamic_growth_steps=growth, name=name)
        self._mp = mp
        self._state_variables: dict = {}

    @property
    def mixed_precision(self):
        """The ``MixedPrecision`` whose step this optimizer runs (a new one after loading)."""
        return self._mp

    def build(self, var_list):
        state = self._mp._state  # the state so far (a checkpoint loaded before compile included)
        for name in FIELDS:
            self._state_variables[name] = self.add_variable(
                shape=(), dtype=_DTYPES[name], initializer=keras.initializers.Constant(getattr(state, name)),
                aggregation="none", name=f"polyamp_{name}")  # fmt: skip
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def dynamic_scale(self):
        """The scale variable (``LossScaleOptimizer.dynamic_scale``'s place)."""
        return self._state_variables["scale"]

    def state_values(self) -> dict:
        """The state's variables' values, on the host (``scaling.state_from_arrays`` reads them)."""
        return {name: ops.convert_to_numpy(var.value) for name, var in self._state_variables.items()}

    def assign_state(self, state) -> None:
        for name, var in self._state_variables.items():
            var.assign(ops.convert_to_tensor(getattr(state, name), dtype=_DTYPES[name]))

    def scale_loss(self, loss):
        if isinstance(self._mp.loss_scale, NoLossScale):
            return loss
        scale = self.dynamic_scale if self.built else self.initial_scale
        return ops.multiply(ops.cast(loss, "float32"), scale)

    # -- the step ------------------------------------------------------------------------------------
    def _step(self, state: dict, grads, trainable_variables, inner_step):
        """(the inner step's result or the variables kept, the new state): one step of the rule above."""
        finite = self.check_finite(grads)
        unscaled = grads
        if not isinstance(self._mp.loss_scale, NoLossScale):
            keep = [g is None or self._overwrite_variable_with_gradient(v)
                    for g, v in zip(grads, self._trainable_variables)]
            unscaled = [g if k else ops.divide(g, state["scale"]) for g, k in zip(grads, keep)]
        kept = inner_step(unscaled, finite)
        return kept, self._mp.loss_scale.update_arrays(state, finite, _Ops)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise PolyampError("build the optimizer before stateless_apply: "
                               "optimizer.build(model.trainable_variables)")  # fmt: skip
        n = len(self._variables)
        own, inner = list(optimizer_variables[:n]), list(optimizer_variables[n:])
        where = {name: next(i for i, v in enumerate(self._variables) if v is var)
                 for name, var in self._state_variables.items()}  # fmt: skip
        state = {name: own[i] for name, i in where.items()}

        def inner_step(unscaled, finite):
            def take():
                return self.inner_optimizer.stateless_apply(inner, unscaled, trainable_variables)

            return ops.cond(finite, take, lambda: (list(trainable_variables), inner))

        (new_trainable, new_inner), new = self._step(state, grads, trainable_variables, inner_step)
        for name, i in where.items():
            own[i] = new[name]
        return list(new_trainable), own + list(new_inner)

    def apply(self, grads, trainable_variables=None):
        """The stateful step (the torch backend's ``fit``, an eager call): as ``stateless_apply``, with
        the skip decided on the host, then the guard."""
        if not self.built:
            self.build(trainable_variables)
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        before = state_from_arrays(self.state_values())

        def inner_step(unscaled, finite):
            if bool(ops.convert_to_numpy(finite)):
                self.inner_optimizer.apply(unscaled, trainable_variables=variables)

        state = {name: var.value for name, var in self._state_variables.items()}
        _, new = self._step(state, list(grads), variables, inner_step)
        for name, var in self._state_variables.items():
            var.assign(new[name])
        check_step(self._mp, before, state_from_arrays(self.state_values()))

    def get_config(self):
        mp = self._mp
        saved = {"policy": mp.policy.name, "loss_scale": mp.loss_scale.as_dict(), "guard": mp.guard}
        return {**super().get_config(), "mixed_precision": saved}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        saved = config.get("mixed_precision")
        if not isinstance(saved, dict) or not {"policy", "loss_scale"} <= saved.keys():
            raise PolyampError("a polyamp KerasOptimizer config needs 'mixed_precision' (policy, "
                               f"loss_scale); received keys {sorted(config)}")  # fmt: skip
        mp = MixedPrecision(saved["policy"], loss_scale=loss_scale_from_dict(saved["loss_scale"]),
                            framework="keras", guard=saved.get("guard", True))  # fmt: skip
        inner = keras.saving.deserialize_keras_object(config["inner_optimizer"], custom_objects)
        return mp.optimizer(inner, name=config.get("name"))


def check_step(mp, before, after) -> None:
    """The host's part of a step: the "fell below 1" warning, then the skip guard."""
    if after.scale < 1 <= before.scale:
        warnings.warn(BELOW_ONE_WARNING, RuntimeWarning, stacklevel=3)
    mp.loss_scale.check(after, skipped_before=before.skipped)


class LossScaleLogger(Callback):
    """A ``fit`` callback that adds ``loss_scale`` (the scale of the next step) and ``skipped_steps``
    (steps skipped so far in this epoch) to the batch and epoch logs, and checks the skip guard at each
    batch end (under JAX the step is compiled: the host sees the state only here)."""

    def __init__(self, mp):
        super().__init__()
        self._mp = mp
        self._before = None
        self._skipped_at_epoch_start = 0

    def _state(self):
        self.model  # noqa: B018 -- Keras syncs a JAX model's state (its optimizer's variables) when read
        return self._mp.state

    def on_train_begin(self, logs=None):
        self._before = self._state()

    def on_epoch_begin(self, epoch, logs=None):
        self._skipped_at_epoch_start = self._state().skipped

    def _log(self, logs, state) -> None:
        if logs is not None:
            logs["loss_scale"] = float(state.scale)
            logs["skipped_steps"] = state.skipped - self._skipped_at_epoch_start

    def on_train_batch_end(self, batch, logs=None):
        state = self._state()
        self._log(logs, state)
        if self._mp._optimizer is not None and keras.backend.backend() == "jax":  # torch: apply() checked
            check_step(self._mp, self._before, state)
        self._before = state

    def on_epoch_end(self, epoch, logs=None):
        self._log(logs, self._state())
