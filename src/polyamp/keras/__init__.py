"""polyamp's front end for Keras 3 on its JAX and torch backends: ``MixedPrecision`` in Keras's ``fit`` idiom.

    os.environ["KERAS_BACKEND"] = "jax"             # before importing keras
    mp = polyamp.MixedPrecision("fp16-mixed", framework="keras")
    with mp.scope():                                # layers take the Keras dtype policy
        model = build_model()
    model.compile(optimizer=mp.optimizer(keras.optimizers.Adam()), loss=...)
    model.fit(x, y, callbacks=[mp.callback()])      # logs loss_scale and skipped_steps, guards

Keras on its TensorFlow backend is ``polyamp.tensorflow``'s (``framework="keras"`` picks whichever front end
drives the backend Keras runs on). This one is written over ``keras.ops`` only (``fit.py``), so the same
code serves JAX and torch; the dtype policies (``policies.py``), ``keep_fp32`` (``keep.py``) and the float32
model check (``model_check.py``) are Keras's and shared with the TensorFlow front end.

- The loss-scale state lives in the optimizer's variables once it is built (``mp.state`` reads them; under
  JAX's ``fit`` they are current at each batch end, after a callback read the model); before that, in
  ``mp``. ``state_dict`` / ``load_state_dict`` work on either.
- What is the TensorFlow front end's alone: custom ``GradientTape`` loops (``mp.scale``/``mp.apply``), the
  recipes, the doctor. A custom loop on the JAX backend is ``polyamp.jax``'s (``model.stateless_call``).
"""

from __future__ import annotations

from typing import Any

import keras

from ..errors import PolyampError
from ..mixed_precision import MixedPrecision as _Base
from ..scaling import LossScaleState, state_from_arrays
from .fit import KerasOptimizer, LossScaleLogger
from .keep import keep_float32
from .model_check import check_model_layers
from .policies import KERAS_POLICIES, check_keras, keras_policy, keras_scope


class MixedPrecision(_Base):
    """Mixed precision for one Keras run on the JAX or torch backend (see ``polyamp.MixedPrecision``)."""

    framework = "keras"

    def _check_recipe(self) -> None:
        raise PolyampError(f"the {self.recipe.name!r} recipe trains with Keras on its TensorFlow backend "
                           "(KERAS_BACKEND=tensorflow), or in polyamp.jax / polyamp.torch; with Keras on JAX "
                           "or torch: the 16-bit policies (bf16-mixed, fp16-mixed, ...)")  # fmt: skip

    def _setup(self) -> None:
        check_keras("keras")
        self._optimizer: KerasOptimizer | None = None
        self._kept: list[str] = []

    @property
    def state(self) -> LossScaleState:
        """The loss-scale state: the optimizer's variables once built, else this object's."""
        if self._optimizer is None or not self._optimizer.built:
            return self._state
        return state_from_arrays(self._optimizer.state_values())

    @state.setter
    def state(self, value: LossScaleState) -> None:
        self._state = value
        if self._optimizer is not None and self._optimizer.built:
            self._optimizer.assign_state(value)

    def scope(self):
        """Context manager: Keras layers built inside it take the policy's dtype policy."""
        keras_policy(self.policy)
        return keras_scope(self.policy)

    def optimizer(self, optimizer: Any, name: str | None = None) -> KerasOptimizer:
        """A Keras optimizer for ``compile``/``fit`` that scales, checks and skips as polyamp does; this
        ``MixedPrecision`` reads its state from then on (one optimizer per ``MixedPrecision``)."""
        self._check_mine(optimizer, "optimizer")
        keras_policy(self.policy)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise PolyampError(f"expected a Keras 3 optimizer (keras.optimizers.Adam, SGD, ...), got "
                               f"{type(optimizer).__name__}")  # fmt: skip
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise PolyampError(
                f"mp.optimizer received a {type(optimizer).__name__}, which already scales the loss; pass "
                "its inner optimizer (polyamp scales, checks and skips in its place)"
            )
        self._check_kept()
        self.loss_scale.check_traceable("compiled Keras")
        if self._optimizer is not None:
            self._state = self.state  # a new optimizer starts from where the last one left off
        self._optimizer = KerasOptimizer(self, optimizer, name=name)
        return self._optimizer

    def callback(self) -> LossScaleLogger:
        """A ``fit`` callback: ``loss_scale`` and ``skipped_steps`` in the logs (so ``History``,
        TensorBoard), and the skip guard checked at each batch end."""
        return LossScaleLogger(self)

    def watch(self, model: Any) -> Any:
        """Warns when the model computes in float32 under a 16-bit policy (built outside ``mp.scope()``);
        under a 16-bit policy the ``keep_fp32`` layers (and those below them) take the "float32" dtype
        policy from here on; a name that matches no layer is an error."""
        self._check_mine(model, "model")
        if not isinstance(model, keras.layers.Layer):
            raise PolyampError(f"expected a Keras model or layer, got {type(model).__name__}")
        check_model_layers(model, self.policy)
        if self.keep_fp32 and self.policy.compute_dtype != "float32":
            self._kept += keep_float32(model, self.keep_fp32)
        return model

    def _check_kept(self) -> None:
        if self.keep_fp32 and self.policy.compute_dtype != "float32" and not self._kept:
            raise PolyampError(
                f"keep_fp32={self.keep_fp32!r} applies to a model: call mp.watch(model) once before "
                "mp.optimizer(...), so that those layers compute in float32"
            )


__all__ = ["KERAS_POLICIES", "KerasOptimizer", "LossScaleLogger", "MixedPrecision", "keras_policy"]
