"""polyamp inside Hugging Face Accelerate: ``polyamp.accelerate.Accelerator("fp16-mixed")`` is an
``accelerate.Accelerator`` whose precision is a torch ``MixedPrecision`` (``accelerator.mp``).

Accelerate's own extension point for loss scaling is its scaler: ``accelerator.backward`` calls
``scaler.scale(loss).backward()``, ``clip_grad_norm_`` first ``unscale_gradients``, and each prepared
optimizer's ``step`` calls ``scaler.step(optimizer)`` then ``scaler.update()``, and reads a skipped step
from whether the optimizer's own ``step`` ran (``optimizer_step_was_skipped``); ``save_state`` /
``load_state`` (and the HF Trainer's ``scaler.pt``) keep ``scaler.state_dict()``. polyamp fills that
slot with :class:`Scaler`, a ``GradScaler``-shaped view of the MixedPrecision: ``scale`` is
``mp.backward_tensor`` (each micro-batch counted), ``unscale_`` is ``mp.unscale_`` (once a step),
``step`` is ``mp.step`` (unscale and check if not done, step or skip, update the scale), ``update`` does
nothing more. The rest of the precision comes from three overrides: ``prepare_model`` watches the model
(``mp.watch``: ``keep_fp32``, a true policy's cast, a recipe's layers) and runs its forward under
``mp.autocast()``, as Accelerate wraps the forward under native AMP; ``autocast()`` is ``mp.autocast()``;
``unscale_gradients`` unscales under every loss-scaled policy (Accelerate's does so only for its fp16
on a GPU: on a CPU it turns on neither autocast nor a scaler, silently).

:func:`attach` turns an ``accelerate.Accelerator`` made without mixed precision into this class, for a
host that builds its own (the HF Trainer: ``polyamp.hf``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import accelerate
from accelerate.optimizer import AcceleratedOptimizer

from ..errors import PolyampError
from ..step import StepResult
from . import MixedPrecision, given_or_made


class Scaler:
    """A ``torch.amp.GradScaler``-shaped view of ``mp`` for hosts that drive a scaler (module docstring);
    ``last_step`` is the last ``StepResult``."""

    def __init__(self, mp: MixedPrecision):
        self.mp = mp
        self.last_step: StepResult | None = None
        self._unscaled: set[int] = set()

    def scale(self, loss):
        return self.mp.backward_tensor(loss)

    def unscale_(self, optimizer) -> None:
        if id(optimizer) not in self._unscaled:  # clipping and a norm read may both ask
            self.mp.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer, closure=None, **kwargs) -> None:
        if closure is not None or kwargs:
            raise PolyampError("polyamp steps the optimizer itself: optimizer.step() takes no closure or "
                               "arguments under polyamp's scaler")  # fmt: skip
        self._unscaled.discard(id(optimizer))
        self.last_step = self.mp.step(optimizer)

    def update(self, new_scale=None) -> None:
        if new_scale is not None:
            raise PolyampError(f"scaler.update(new_scale={new_scale!r}): polyamp's loss scale follows its "
                               "own rule (mp.loss_scale); set it with loss_scale= when making the "
                               "MixedPrecision")  # fmt: skip

    def get_scale(self) -> float:
        return self.mp.current_scale

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict:
        return self.mp.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.mp.load_state_dict(state)


class Accelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` running ``policy`` (a policy or recipe name, or a torch
    ``MixedPrecision``); ``loss_scale=``, ``keep_fp32=``, ``device=`` go to the MixedPrecision, every other
    keyword to Accelerate, which must not be given its own ``mixed_precision``."""

    def __init__(self, policy: Any = "bf16-mixed", *args, loss_scale=None, keep_fp32=(), device=None,
                 **kwargs):  # fmt: skip
        if kwargs.get("mixed_precision") not in (None, "no"):
            raise PolyampError(f"mixed_precision={kwargs['mixed_precision']!r}: polyamp's Accelerator runs "
                               f"the policy it is given ({policy!r}); leave Accelerate's mixed_precision "
                               "unset")  # fmt: skip
        given = (("loss_scale", loss_scale), ("keep_fp32", keep_fp32), ("device", device))
        options = {k: v for k, v in given if v}
        mp = given_or_made(policy, options)
        super().__init__(*args, **{**kwargs, "mixed_precision": "no"})
        self._adopt(mp)

    def _adopt(self, mp: MixedPrecision) -> None:
        self.mp = mp
        self.scaler = Scaler(mp)
        self._watched: set[int] = set()

    def prepare_model(self, model, device_placement=None, evaluation_mode: bool = False):
        if id(model) not in self._watched:
            self.mp.watch(model)
            self._watched.add(id(model))
        model = super().prepare_model(model, device_placement, evaluation_mode)
        if not getattr(model.forward, "_polyamp_autocast", False):
            model.forward = _under(self.mp, model.forward)
        return model

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        if autocast_handler is not None:
            raise PolyampError("autocast_handler is Accelerate's native-AMP setting; polyamp's autocast "
                               "follows its policy")  # fmt: skip
        with self.mp.autocast():
            yield

    def unscale_gradients(self, optimizer=None) -> None:
        optimizers = self._optimizers if optimizer is None else optimizer
        for opt in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.scaler.unscale_(opt)


def _under(mp: MixedPrecision, forward):
    """``forward`` run under ``mp.autocast()``."""

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with mp.autocast():
            return forward(*args, **kwargs)

    autocast_forward._polyamp_autocast = True
    return autocast_forward


def attach(accelerator: accelerate.Accelerator, mp: MixedPrecision) -> Accelerator:
    """``accelerator`` (made without mixed precision, nothing prepared yet) running ``mp`` from here on:
    its class becomes :class:`Accelerator` and its scaler polyamp's."""
    if type(accelerator) is not accelerate.Accelerator:
        raise PolyampError(f"attach takes an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.mixed_precision != "no" or accelerator.scaler is not None:
        raise PolyampError(f"this Accelerator already runs Accelerate's mixed_precision="
                           f"{accelerator.mixed_precision!r}; polyamp runs {mp.policy.name!r} in its "
                           "place: make it without mixed precision (HF TrainingArguments: fp16=False, "
                           "bf16=False)")  # fmt: skip
    if accelerator._optimizers or accelerator._models:
        raise PolyampError("attach polyamp before accelerator.prepare(...): a prepared optimizer holds no "
                           "scaler")
    accelerator.__class__ = Accelerator
    accelerator._adopt(mp)
    return accelerator


__all__ = ["Accelerator", "Scaler", "attach"]
