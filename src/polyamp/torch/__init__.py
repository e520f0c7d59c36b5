"""polyamp's PyTorch front end: ``MixedPrecision`` in torch's idiom.

    mp = polyamp.MixedPrecision("bf16-mixed")      # this class, when torch is the framework
    with mp.autocast():                             # torch.autocast to the compute dtype
        loss = loss_fn(model(x), y)
    mp.backward(loss)                               # backward of loss * scale
    result = mp.step(optimizer, clip_grad_norm=1.0) # unscale, check, clip, step or skip, update

The step is ``polyamp.eager``'s; ``ops.py`` holds torch's primitives (fused unscale-and-check,
distributed agreement, hooks). ``mp.unscale_(optimizer)`` is ``GradScaler.unscale_``.
"""

from __future__ import annotations

from typing import Any

from ..eager import EagerMixedPrecision
from ..errors import PolyampError
from ..recipes import recipe_spec
from .low_optim import LowPrecisionOptimizer
from .ops import TorchOps, default_device
from .weight_only import LowWeightLinear, WeightOnlyRecord, quantize_weights


class MixedPrecision(EagerMixedPrecision):
    """Mixed precision for one PyTorch training run (see ``polyamp.MixedPrecision``); with a recipe
    (``MixedPrecision("fp8-tensorwise")``), ``recipe.py``'s quantized matmuls under ``mp.autocast()``."""

    framework = "torch"
    ops = TorchOps()
    takes_training_state = True

    def _setup(self) -> None:
        super()._setup()
        self._layers = None  # the recipe's LayerStack, from mp.watch(model)
        self._quantizer = None
        if self.recipe is not None:
            from .recipe import Quantizer

            self._quantizer = Quantizer(self.recipe, self.process_group)

    def watch(self, model: Any) -> Any:
        layers = None
        if self._quantizer is not None:  # the keep list checked before anything is installed
            from .recipe import LayerStack

            self._check_mine(model, "model")
            layers = LayerStack(model, self.recipe.keep, recipe_spec(self.recipe))
        try:
            model = super().watch(model)
        except BaseException:
            if layers is not None:
                layers.remove()
            raise
        if layers is not None:
            if self._layers is not None:
                self._layers.remove()
            self._layers = layers
            self._recipe_layers = layers.record
            layers.warn_if_none("mp.watch")
        return model

    def autocast(self, *, device: str | None = None, enabled: bool = True):
        if self._quantizer is None or not enabled:
            return super().autocast(device=device, enabled=enabled)
        if self._layers is None:
            raise PolyampError(
                f"the {self.recipe.name!r} recipe quantizes the matmuls of a watched model: call "
                "mp.watch(model) once before training (and again after unpickling this MixedPrecision: "
                "a watch binds it to the model's modules in this process and does not travel)"
            )
        from .recipe import autocast

        if device is not None and device != self.device:
            self.ops.check_device(device)
        return autocast(self._quantizer, self._layers, device or self.device or default_device())

    def _recipe_state(self) -> dict | None:
        """The recipe's delayed-scaling histories and rounding counter."""
        return None if self._quantizer is None else self._quantizer.state_dict()

    def _recipe_loader(self, state: Any):
        return lambda: self._quantizer.load_state_dict(state)

    # -- pickling ----------------------------------------------------------------------------------
    # what binds the object to this process's tensors and modules: rebuilt by the next mp.watch / step
    _TRANSIENT = {"_names": dict, "_origin": list, "_hooks": list, "_kept": list,
                  "_stepped_grads": lambda: None, "_layers": lambda: None}  # fmt: skip

    def __getstate__(self) -> dict:
        """Pickled (``pickle``, ``copy.deepcopy``, ``torch.save`` of the object) at any point but between
        ``mp.unscale_`` and ``mp.step`` (as ``GradScaler``): the policy, the loss scale and its state, the
        recipe with its quantizer state (delayed histories, rounding counter) and ``mp.recipe_layers``.
        Dropped (``_TRANSIENT``): what refers to this process's tensors and modules (the step guard's
        gradient fingerprints, parameter names, the watch's hooks), so a recipe, ``keep_fp32`` or
        ``debug=True`` needs ``mp.watch(model)`` again after unpickling (each says so if it is not)."""
        if self._unscaled:
            raise PolyampError("this MixedPrecision cannot be pickled between mp.unscale_(optimizer) and "
                               "mp.step(optimizer) (its optimizers' gradients are unscaled, a state of "
                               "this process's tensors): pickle it before unscale_ or after step, as "
                               "GradScaler")  # fmt: skip
        if self.process_group is not None:
            raise PolyampError(f"this MixedPrecision holds process_group={self.process_group!r}, a "
                               "torch.distributed group of this process, which does not pickle: create "
                               "the MixedPrecision in each process (mp.state_dict() carries its "
                               "state)")  # fmt: skip
        state = dict(self.__dict__)
        state.update((k, make()) for k, make in self._TRANSIENT.items())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for k, make in self._TRANSIENT.items():
            self.__dict__.setdefault(k, make())

    def optimizer(self, optimizer: Any, seed: int = 0) -> Any:
        """``optimizer`` as the policy's training-state options want it: a ``LowPrecisionOptimizer``
        (``low_optim.py``) for ``bf16-true:sr`` / ``:kahan`` / ``states=...``, else ``optimizer`` itself."""
        options = self.policy.state
        if options is None or not options.trains:
            return optimizer
        from .low_optim import LowPrecisionOptimizer

        return LowPrecisionOptimizer(optimizer, options.update, options.states, seed)

    def step(self, optimizer: Any, batch_size: int | None = None, clip_grad_norm: float | None = None):
        if self.policy.state is not None and self.policy.state.trains:
            from .low_optim import LowPrecisionOptimizer

            plain = [o for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])
                     if not isinstance(o, LowPrecisionOptimizer)]  # fmt: skip
            if plain:
                raise PolyampError(f"policy {self.policy.name!r} updates weights and moments through "
                                   f"polyamp: wrap the optimizer once, optimizer = mp.optimizer(optimizer), "
                                   f"and step that (got a plain {type(plain[0]).__name__})")  # fmt: skip
        return super().step(optimizer, batch_size, clip_grad_norm)

    def unscale_(self, optimizer: Any) -> bool:
        """Unscale ``optimizer``'s gradients now, so that code can read or change them before
        ``mp.step`` (which then does not unscale them again); returns whether they are finite.

        As ``GradScaler.unscale_``: once per optimizer between two steps.
        """
        return self._unscale_early(optimizer)


def given_or_made(policy: Any, kwargs: dict) -> MixedPrecision:
    """The ready ``MixedPrecision`` a host plug-in was given, or one made from a policy or recipe name
    and its keywords (Lightning, the HF Trainer, Accelerate)."""
    if isinstance(policy, MixedPrecision):
        if kwargs:
            raise PolyampError(f"give a policy with options ({', '.join(kwargs)}) or a ready MixedPrecision, "
                               "not both")  # fmt: skip
        return policy
    return MixedPrecision(policy, framework="torch", **kwargs)


__all__ = ["LowPrecisionOptimizer", "LowWeightLinear", "MixedPrecision", "TorchOps", "WeightOnlyRecord",
           "given_or_made", "quantize_weights"]
