"""polyamp's TensorFlow / Keras 3 front end: ``MixedPrecision`` in Keras's idiom.

    mp = polyamp.MixedPrecision("bf16-mixed")      # this class, when TensorFlow is the framework
    with mp.scope():                                # layers take the Keras dtype policy
        model = build_model()
    model.compile(optimizer=mp.optimizer(keras.optimizers.Adam()), loss=...)   # fit
    # or a custom loop (eager or inside tf.function):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    grads = tape.gradient(mp.scale(loss), model.trainable_variables)
    result = mp.apply(optimizer, grads, model.trainable_variables, clip_grad_norm=1.0)

- The loss-scale state lives in ``tf.Variable``s (float32 scale, int32 counters;
  ``LossScaleVariables``): ``mp.state``/``current_scale``/``state_dict()`` read them and
  ``load_state_dict`` assigns them, so the same step runs eagerly and inside ``tf.function``.
  The step is ``step.py``'s; the Keras dtype policies and ``mp.scope()`` are ``policies.py``'s.
- Variables with Keras's ``overwrite_with_gradient`` take their "gradient" as their new value, as
  Keras's ``LossScaleOptimizer`` passes it: it is checked for inf/NaN but neither unscaled nor
  clipped nor counted in the norm. An inner optimizer's ``loss_scale_factor`` is cleared (as
  ``LossScaleOptimizer`` does), so the update is not divided a second time.
- Eagerly the ``StepResult`` holds Python values and names this replica's non-finite gradients and
  the replicas whose gradients were not finite, and the "scale fell below 1" warning is given;
  inside ``tf.function`` it holds tensors (a tf.function may return it), ``nonfinite`` and
  ``nonfinite_ranks`` are empty, no warning is given, and the skip guard is a graph assertion
  (dropped by XLA) whose error names polyamp's ``NonFiniteError``.
- A model that computes in float32 under a 16-bit policy (built outside ``mp.scope()``) gets one
  warning per ``MixedPrecision`` (``model_check.py``).
- ``PolyampOptimizer`` (``mp.optimizer``, ``fit.py``) is a registered Keras serializable: its config
  holds the policy, the loss-scale config and state, so a ``.keras`` model reloads and trains on
  with the same scale. ``LossScaleLogger`` puts the scale and the skipped steps into ``fit``'s logs.
- Under a distribution strategy, build the optimizer before the first ``tf.function`` step
  (TensorFlow cannot initialise mirrored variables created inside it; polyamp says so).
- ``keep_fp32`` (layer names as ``polyamp.tensorflow.doctor.collect`` gives them): ``mp.watch(model)``
  sets those layers (and the layers below them) to the "float32" Keras dtype policy (``keep.py``);
  under a 16-bit policy, ``mp.apply`` and ``mp.optimizer`` ask for that ``watch`` first.
- With a recipe (``MixedPrecision("mxfp8")``), ``mp.watch(model)`` makes the model's Dense, EinsumDense
  and Conv layers run the recipe's quantized GEMMs (``recipe.py``) and sets ``mp.recipe_layers`` (every
  matmul layer by its path: quantized, or kept and why; a ``RecipeWarning`` when none is quantized);
  ``mp.apply`` and ``mp.optimizer`` ask for it first, and ``state_dict()`` holds the recipe's state (the
  stochastic-rounding counter, delayed-scaling histories).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from ..errors import PolyampError
from ..keras.keep import keep_float32
from ..keras.policies import KERAS_POLICIES, check_keras, keras_policy, keras_scope
from ..mixed_precision import MixedPrecision as _Base
from ..recipes import recipe_spec
from ..scaling import LossScaleState, NoLossScale
from ..step import StepResult, check_clip_norm
from .model_check import check_model_layers, check_traced_loss
from .step import LossScaleVariables, attach, check_optimizer, check_pairs, run_step, variable_name

_COMPUTE = {"bf16": tf.bfloat16, "fp32": tf.float32}


class MixedPrecision(_Base):
    """Mixed precision for one TensorFlow / Keras training run (see ``polyamp.MixedPrecision``)."""

    framework = "tensorflow"

    def _setup(self) -> None:
        self._names: dict[int, str] = {}
        self._variables: LossScaleVariables | None = None
        self._kept: list[str] = []  # the layers mp.watch set to float32 for keep_fp32
        self._dense = None  # the recipe's MatmulLayers, from mp.watch(model)
        self._quantizer = None
        if self.recipe is not None:
            from .recipe import Quantizer

            self._quantizer = Quantizer(self.recipe)

    @property
    def state(self) -> LossScaleState:
        """The loss-scale state, read from its ``tf.Variable``s once they exist (eagerly: inside a
        tf.function the values are tensors of the trace; ``loss_scale_variables()`` holds them)."""
        if self._variables is None:
            return self._state
        if tf.inside_function():
            raise PolyampError("mp.state (and mp.current_scale) is read eagerly, outside a tf.function; "
                               "inside one use mp.loss_scale_variables().scale (a tf.Variable)")  # fmt: skip
        return self._variables.read()

    @state.setter
    def state(self, value: LossScaleState) -> None:
        self._state = value
        if self._variables is not None:
            self._variables.write(value)

    def loss_scale_variables(self) -> LossScaleVariables:
        """The state's ``tf.Variable``s, created (outside any tf.function) on first use."""
        if self._variables is None:
            self.loss_scale.check_traceable("tf.function")
            with tf.init_scope():
                self._variables = LossScaleVariables(self._state)
        return self._variables

    def parameter_name(self, variable) -> str:
        """The name ``watch`` learned for ``variable``, else its own path."""
        return self._names.get(id(variable), variable_name(variable))

    # -- the Keras idiom -------------------------------------------------------------------------
    def scope(self):
        """Context manager: Keras layers built inside it take the policy's dtype policy."""
        check_keras()
        keras_policy(self.policy)
        self.loss_scale_variables()  # under the caller's distribution strategy, if any
        return keras_scope(self.policy)

    def optimizer(self, optimizer: Any):
        """A Keras optimizer for ``compile``/``fit`` that scales, checks and skips as polyamp does."""
        self._check_mine(optimizer, "optimizer")
        check_keras()
        keras_policy(self.policy)
        check_optimizer(optimizer)
        self._check_kept()
        return PolyampOptimizer(self, optimizer)

    def callback(self):
        """A Keras ``fit`` callback that adds ``loss_scale`` and ``skipped_steps`` to the logs
        (so to ``History`` and TensorBoard): ``model.fit(..., callbacks=[mp.callback()])``."""
        return LossScaleLogger(self)

    # -- the custom-loop idiom -------------------------------------------------------------------
    # Both build their ops without AutoGraph (Python control flow on Python values only), so a
    # tf.function calling them does not convert polyamp's code (0.6-0.9 s of the first step: BENCHMARKS).
    @tf.autograph.experimental.do_not_convert
    def scale(self, loss: Any):
        """``loss * scale`` in float32 for a custom ``GradientTape`` loop (usable inside
        ``tf.function``; a float16 loss times 2^15 would overflow float16)."""
        self._check_mine(loss, "loss")
        keras_policy(self.policy)
        if not (tf.is_tensor(loss) and loss.dtype.is_floating):
            raise PolyampError(
                "loss must be a floating-point TensorFlow tensor, got "
                f"{getattr(loss, 'dtype', type(loss).__name__)}"
            )
        if loss.shape.num_elements() not in (1, None):
            raise PolyampError(f"loss must be a scalar, got a tensor of shape {loss.shape}")
        check_traced_loss(self, loss)
        if isinstance(self.loss_scale, NoLossScale):
            return loss
        if loss.dtype in (tf.float16, tf.bfloat16):
            loss = tf.cast(loss, tf.float32)
        return loss * tf.cast(self.loss_scale_variables().scale, loss.dtype)

    @tf.autograph.experimental.do_not_convert
    def apply(self, optimizer: Any, grads: Any, variables: Any, clip_grad_norm: float | None = None
              ) -> StepResult:  # fmt: skip
        """Unscale, check, clip, apply or skip, update the scale; returns a ``StepResult``."""
        self._check_mine(optimizer, "optimizer")
        check_keras()
        keras_policy(self.policy)
        check_optimizer(optimizer)
        grads, variables = check_pairs(grads, variables)
        check_clip_norm(clip_grad_norm)
        self._check_kept()
        attach(optimizer, self.loss_scale_variables())
        # mp.scale did the scaling: an inner factor would divide the update again (cleared as
        # LossScaleOptimizer clears it)
        optimizer.loss_scale_factor = None
        return run_step(self, optimizer, grads, variables, clip_grad_norm)

    def watch(self, model: Any) -> Any:
        """Learn the model's variable names (for ``StepResult.nonfinite``); warns when the model
        computes in float32 under a 16-bit policy (built outside ``mp.scope()``). Under a 16-bit
        policy the ``keep_fp32`` layers (and those below them) take the "float32" dtype policy from
        here on; a name that matches no layer is an error."""
        self._check_mine(model, "model")
        if not isinstance(model, (keras.layers.Layer, tf.Module)):
            raise PolyampError(f"expected a Keras model or layer, got {type(model).__name__}")
        dense = None
        if self._quantizer is not None:  # the keep list checked before anything is changed
            from .recipe import MatmulLayers

            dense = MatmulLayers(model, self.recipe.keep)
        check_model_layers(model, self.policy)
        if self.keep_fp32 and self.policy.compute_dtype != "float32":
            self._kept += keep_float32(model, self.keep_fp32)
        self._names.update({id(v): variable_name(v) for v in model.variables})
        if dense is not None:
            if self._dense is not None:
                self._dense.remove()
            dense.install(self._quantizer, _COMPUTE[self.recipe.compute_dtype])
            self._dense = dense
            self._recipe_layers = dense.record(recipe_spec(self.recipe))
            self._recipe_layers.warn_if_none("Keras", "mp.watch")
        return model

    def _recipe_state(self) -> dict | None:
        """The recipe's counter and amax histories."""
        return None if self._quantizer is None else self._quantizer.state_dict()

    def _recipe_loader(self, state: Any):
        if self._dense is None and isinstance(state, dict) and state.get("delayed"):
            raise PolyampError("the checkpoint holds amax histories of a model's layers: call "
                               "mp.watch(model) before mp.load_state_dict(...)")  # fmt: skip
        return lambda: self._quantizer.load_state_dict(state)

    def _check_kept(self) -> None:
        if self._quantizer is not None and self._dense is None:
            raise PolyampError(
                f"the {self.recipe.name!r} recipe quantizes the matmul layers of a watched model: call "
                "mp.watch(model) once before training (before mp.optimizer(...) for fit)"
            )
        if self.keep_fp32 and self.policy.compute_dtype != "float32" and not self._kept:
            raise PolyampError(
                f"keep_fp32={self.keep_fp32!r} applies to a model: call mp.watch(model) once before "
                "training (before mp.optimizer(...) for fit), so that those layers compute in float32"
            )


# the fit path; imported here so that Keras can find PolyampOptimizer when a .keras file loads
from .fit import LossScaleLogger, PolyampOptimizer  # noqa: E402

__all__ = ["KERAS_POLICIES", "LossScaleLogger", "LossScaleVariables", "MixedPrecision", "PolyampOptimizer",
           "keras_policy"]  # fmt: skip
