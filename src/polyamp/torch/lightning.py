"""polyamp as a Lightning precision plugin: ``Trainer(plugins=[polyamp.lightning.Precision("fp16-mixed")])``
and ``Fabric(plugins=[polyamp.lightning.FabricPrecision("mxfp8")])``.

Each plugin holds one torch ``MixedPrecision`` (``plugin.mp``) and maps Lightning's precision hooks onto
it, the way Lightning's own ``MixedPrecision`` plugin maps them onto a ``GradScaler``:

- ``convert_module``: ``mp.watch(model)`` (parameter names, ``keep_fp32``, a true policy's cast, a recipe's
  quantized layers); ``forward_context``: ``mp.autocast()`` (training, validation, test and predict steps);
- ``pre_backward`` (Trainer) / ``backward`` (Fabric): the loss times the loss scale, each micro-batch
  counted (``mp.backward_tensor``), so gradient accumulation adds scaled gradients;
- ``optimizer_step`` (Trainer): run the closure (training step and backward), then ``mp.unscale_`` (unscale
  and inf/NaN check in one pass), then Lightning's ``on_before_optimizer_step`` hooks and gradient
  clipping on the unscaled gradients, then ``mp.step``: the optimizer steps or the step is skipped, and
  the loss scale is updated. A training step that returns None skips backward and step, as in Lightning.
  Fabric's ``unscale_gradients`` (before ``fabric.clip_gradients``) is ``mp.unscale_``, its
  ``optimizer_step`` ``mp.step``;
- ``state_dict`` / ``load_state_dict``: ``mp.state_dict()`` (loss scale, counters, a recipe's state),
  saved in Lightning's checkpoints under the plugin's class name.

After each step the plugin keeps ``last_step`` (``StepResult``) and ``skipped`` (steps skipped so far),
and under the Trainer logs ``polyamp/loss_scale`` and ``polyamp/skipped`` through the LightningModule's
loggers (``log=False`` turns that off). Unlike Lightning's ``"16-mixed"``, fp16 on a CPU scales the loss
here too, and an optimizer that unscales inside its step (a fused Adam) can be clipped: polyamp unscales
before the optimizer runs. The L-BFGS optimizer, which re-evaluates its closure, is refused, as by
Lightning's plugin.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch
from lightning.fabric.plugins import Precision as _FabricBase
from lightning.pytorch.plugins.precision import Precision as _TrainerBase

from ..errors import PolyampError
from ..step import StepResult
from . import MixedPrecision, given_or_made

# Lightning's own name for the compute a policy runs (``trainer.precision``); a recipe computes in bf16
_LIGHTNING_NAME = {"float32": "32-true", "bfloat16": "bf16-mixed", "float16": "16-mixed"}


def _lightning_name(mp: MixedPrecision) -> str:
    policy = mp.policy
    if policy.param_dtype != "float32" and policy.compute_dtype != "float32":
        return "bf16-true" if policy.compute_dtype == "bfloat16" else "16-true"
    return _LIGHTNING_NAME[policy.compute_dtype]


def _check_optimizer(optimizer) -> None:
    if isinstance(optimizer, torch.optim.LBFGS):
        raise PolyampError("polyamp's precision plugins do not take the L-BFGS optimizer: it evaluates its "
                           "closure several times a step, each a backward of the scaled loss")  # fmt: skip


class _Steps:
    """What both plugins share: the MixedPrecision, the record of the last step, the checkpoint hooks."""

    def _init(self, policy, kwargs: dict) -> None:
        self.mp = given_or_made(policy, kwargs)
        self.precision = _lightning_name(self.mp)
        self.last_step: StepResult | None = None
        self.skipped = 0

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.mp.watch(module)

    @contextmanager
    def forward_context(self):
        with self.mp.autocast():
            yield

    def _step(self, optimizer) -> StepResult:
        result = self.mp.step(optimizer)
        self.last_step = result
        self.skipped += not result.stepped
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.mp.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mp.load_state_dict(state_dict)


class Precision(_Steps, _TrainerBase):
    """A Lightning ``Trainer`` precision plugin running ``policy`` (a policy or recipe name, or a torch
    ``MixedPrecision``; other keywords go to ``MixedPrecision``: ``loss_scale``, ``keep_fp32``, ``device``,
    ...). The hooks: module docstring."""

    def __init__(self, policy: Any = "bf16-mixed", *, log: bool = True, **kwargs):
        self._init(policy, kwargs)
        self.log = log

    def pre_backward(self, tensor: torch.Tensor, module) -> torch.Tensor:
        return super().pre_backward(self.mp.backward_tensor(tensor), module)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs) -> Any:
        _check_optimizer(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:  # the training step skipped backward
            return closure_result
        self.mp.unscale_(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step, then clipping: unscaled gradients
        result = self._step(optimizer)
        if self.log and _logs_this_step(model, result):
            model.log_dict({"polyamp/loss_scale": result.scale, "polyamp/skipped": float(self.skipped)},
                           on_step=True, on_epoch=False)  # fmt: skip
        return closure_result


def _logs_this_step(model, result: StepResult) -> bool:
    """Whether to log this step: where the Trainer writes its logs (``log_every_n_steps``), on a skipped
    step, and on the last step (of ``max_steps`` or of the epoch), whose values the logs end with.
    ``self.log`` costs about 1 ms a call on a CPU, more than polyamp's whole step; a Trainer without
    Lightning's bookkeeping attributes logs every step."""
    trainer = getattr(model, "_trainer", None)
    if trainer is None:
        return False
    try:
        writes = trainer._logger_connector.should_update_logs
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    except AttributeError:
        return True
    max_steps = getattr(trainer, "max_steps", -1) or -1
    return bool(writes or last or not result.stepped or 0 < max_steps <= trainer.global_step + 1)


class FabricPrecision(_Steps, _FabricBase):
    """A Lightning ``Fabric`` precision plugin running ``policy`` (as :class:`Precision`)."""

    def __init__(self, policy: Any = "bf16-mixed", **kwargs):
        self._init(policy, kwargs)
        self._unscaled: set[int] = set()

    def backward(self, tensor: torch.Tensor, model, *args, **kwargs) -> None:
        self.mp.backward_tensor(tensor).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer) -> None:
        if id(optimizer) not in self._unscaled:  # fabric.clip_gradients may come more than once
            self.mp.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer, **kwargs) -> Any:
        _check_optimizer(optimizer)
        if kwargs:
            raise PolyampError(f"optimizer.step({', '.join(f'{k}=...' for k in kwargs)}): polyamp's Fabric "
                               "plugin steps the optimizer itself and takes no step arguments")  # fmt: skip
        self._unscaled.discard(id(optimizer))
        return self._step(optimizer)


__all__ = ["FabricPrecision", "Precision"]
