"""The Keras ``compile``/``fit`` path: ``PolyampOptimizer`` (``mp.optimizer``) and the
``LossScaleLogger`` callback (``mp.callback()``). The step itself is ``step.run_step``."""

from __future__ import annotations

import keras
from keras.callbacks import Callback

from ..errors import PolyampError
from ..mixed_precision import MixedPrecision
from ..scaling import loss_scale_from_dict
from .step import LossScaleVariables, check_pairs, run_step


@keras.saving.register_keras_serializable(package="polyamp")
class PolyampOptimizer(keras.optimizers.LossScaleOptimizer):
    """A Keras optimizer for ``compile``/``fit`` that scales, checks and skips as polyamp does.

    ``fit`` multiplies the loss by ``scale_loss`` (polyamp's scale) and hands the gradients to
    ``apply``, which runs polyamp's step on the inner optimizer. It subclasses Keras's
    ``LossScaleOptimizer`` only so that ``compile`` does not wrap it a second time under a
    ``mixed_float16`` policy; none of that class's scaling runs. ``initial_scale`` and
    ``dynamic_growth_steps`` describe polyamp's loss scale (None where it does not grow); the
    config adds ``mixed_precision`` (``MixedPrecision.state_dict()``: policy, loss-scale config
    and state) and ``guard``, from which ``from_config`` rebuilds the ``MixedPrecision``.
    """

    def __init__(self, mp, inner_optimizer, name=None):
        initial = mp.loss_scale.init().scale
        growth = getattr(mp.loss_scale, "growth_interval", None)
        super().__init__(inner_optimizer, initial_scale=initial, dynamic_growth_steps=growth, name=name)
        self._mp = mp
        self._polyamp_loss_scale = mp.loss_scale_variables()

    @property
    def mixed_precision(self):
        """The ``MixedPrecision`` whose step this optimizer runs (a new one after loading)."""
        return self._mp

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def dynamic_scale(self):
        return self._polyamp_loss_scale.scale

    def scale_loss(self, loss):
        return self._mp.scale(loss)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        grads, variables = check_pairs(grads, variables)
        run_step(self._mp, self.inner_optimizer, grads, variables, None)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise PolyampError("stateless_apply is JAX's path; with TensorFlow use apply()")

    def get_config(self):
        return {**super().get_config(), "mixed_precision": self._mp.state_dict(), "guard": self._mp.guard}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        saved = config.get("mixed_precision")
        if not isinstance(saved, dict) or not {"policy", "loss_scale", "state"} <= saved.keys():
            raise PolyampError(
                "a PolyampOptimizer config needs 'mixed_precision' (MixedPrecision.state_dict(): "
                f"policy, loss_scale, state); received keys {sorted(config)}"
            )
        mp = MixedPrecision(saved["policy"], loss_scale=loss_scale_from_dict(saved["loss_scale"]),
                            framework="tensorflow", guard=config.get("guard", True))  # fmt: skip
        mp.load_state_dict(saved)
        inner = keras.saving.deserialize_keras_object(config["inner_optimizer"], custom_objects)
        return cls(mp, inner, name=config.get("name"))


class LossScaleLogger(Callback):
    """A ``fit`` callback that adds ``loss_scale`` (the scale of the next step) and
    ``skipped_steps`` (steps skipped so far in this epoch) to the batch and epoch logs, so that the
    progress bar, ``History`` and the callbacks listed after it (TensorBoard, CSVLogger) get them.

    Without ``mp`` it reads the ``PolyampOptimizer`` the model was compiled with.
    """

    def __init__(self, mp=None):
        super().__init__()
        self._mp = mp
        self._skipped_at_epoch_start = 0

    def _variables(self) -> LossScaleVariables:
        if self._mp is not None:
            return self._mp.loss_scale_variables()
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, PolyampOptimizer):
            raise PolyampError(
                "LossScaleLogger() logs the loss scale of a model compiled with mp.optimizer(...); "
                f"this model's optimizer is a {type(optimizer).__name__}: compile with "
                "mp.optimizer(optimizer), or pass the MixedPrecision: LossScaleLogger(mp)"
            )
        return optimizer.mixed_precision.loss_scale_variables()

    def on_epoch_begin(self, epoch, logs=None):
        self._skipped_at_epoch_start = int(self._variables().skipped.numpy())

    def _log(self, logs) -> None:
        if logs is not None:
            store = self._variables()
            logs["loss_scale"] = float(store.scale.numpy())
            logs["skipped_steps"] = int(store.skipped.numpy()) - self._skipped_at_epoch_start

    def on_train_batch_end(self, batch, logs=None):
        self._log(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._log(logs)
