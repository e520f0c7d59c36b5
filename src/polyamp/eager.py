"""The eager step, written once for the eager front ends (``polyamp.torch``, ``polyamp.mxnet``).

``mp.step(optimizer)``:

1. unscale the gradients by ``1/scale`` and check them for inf/NaN in one fused pass;
2. agree on the finite flag across ranks (all-reduce) when training is distributed;
3. if finite: clip by global norm (optional) and run the optimizers; else skip them;
4. update the loss scale (``scaling.py``); after too many consecutive skips raise
   ``NonFiniteError`` naming where the first non-finite value came from.

Every policy guards the update: a non-finite step is skipped also when no loss scaling is needed
(bf16, fp32), unless ``guard=False``. A front end supplies the framework's primitives as an
:class:`EagerOps` (the whole contract) and adds its own idiom (torch's ``unscale_``, MXNet's
``trainer``/``scale_loss``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from .errors import PolyampError, UnsupportedError
from .mixed_precision import MixedPrecision
from .step import StepResult, check_clip_norm, is_number


class EagerOps:
    """The primitives an eager framework supplies; each raises ``PolyampError`` on bad input."""

    takes_batch_size = False  # whether the optimizer step needs the batch size (MXNet's Trainer)

    def check_device(self, device: str | None) -> None:
        """PolyampError unless ``device`` names a device this framework can autocast on."""

    def autocast(self, policy, device: str | None):
        """A context manager running ops in the policy's compute dtype."""
        raise NotImplementedError

    def scale_loss(self, loss: Any, scale: float) -> Any:
        """``loss * scale``, after checking that ``loss`` is a floating scalar."""
        raise NotImplementedError

    def gradients(self, optimizers: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(gradients, their parameters) that the optimizers will apply, validated."""
        raise NotImplementedError

    def check_params(self, optimizers: Sequence[Any], policy) -> None:
        """PolyampError when the parameters are not in the policy's parameter dtype."""

    def unscale_and_check(self, grads: list[Any], inv_scale: float, group: Any = None
                          ) -> tuple[bool, tuple[int, ...]]:  # fmt: skip
        """Multiply grads by ``inv_scale`` in place; (True when all are finite on every rank, the
        ranks whose gradients were not). One fused pass over the gradients and one host
        synchronisation; the flag is all-reduced across the distributed group when one is active."""
        raise NotImplementedError

    def clip(self, grads: list[Any], params: list[Any], max_norm: float) -> float:
        """Clip by global norm; returns the norm before clipping."""
        raise NotImplementedError

    def nonfinite(self, named_grads: list[tuple[str, Any]]) -> tuple[str, ...]:
        """Names of the gradients that hold inf or NaN (only called after a failed check)."""
        raise NotImplementedError

    def apply(self, optimizers: Sequence[Any], batch_size: int | None = None) -> None:
        """Run the optimizers' update (``batch_size``: MXNet's ``Trainer.step`` argument)."""
        raise NotImplementedError

    def fingerprint(self, grads: list[Any]) -> Any:
        """Something that tells these gradient tensors, unchanged, from any later ones."""
        return None

    def unchanged(self, grads: list[Any], fingerprint: Any) -> bool:
        """True when ``grads`` are the very tensors, unmodified, that ``fingerprint`` was taken of."""
        return False

    def prepare_model(self, model: Any, policy, keep_fp32: tuple[str, ...] = ()) -> Any:
        """The model with its parameters in the policy's parameter dtype (``mp.watch``), but those of
        the ``keep_fp32`` layers."""
        return model

    def parameter_names(self, model: Any) -> dict[int, str]:
        """``id(parameter) -> qualified name`` for a model."""
        raise NotImplementedError

    def keep_float32(self, model: Any, keep_fp32: tuple[str, ...]) -> list[Any]:
        """Make the layers ``keep_fp32`` names (and those below them) compute in float32 under
        autocast; PolyampError for a name that matches no layer. Returns handles with ``remove()``."""
        raise UnsupportedError(f"keep_fp32 is not available for {type(self).__name__}")

    def watch_nonfinite(self, model: Any, origin: list[str]) -> list[Any]:
        """Install hooks that append to ``origin`` where a non-finite value first appears
        (forward output or gradient); returns handles with ``remove()``."""
        raise NotImplementedError


class EagerMixedPrecision(MixedPrecision):
    """``backward``, ``step``, ``watch`` and ``autocast`` over the front end's ``ops``."""

    ops: EagerOps

    def _setup(self) -> None:
        self.ops.check_device(self.device)
        self._names: dict[int, str] = {}
        self._origin: list[str] = []
        self._hooks: list[Any] = []
        self._kept: list[Any] = []  # the handles of mp.watch's keep_fp32
        self._backwards = 0  # backward / scale_loss calls since the last step
        self._stepped_grads: Any = None  # the gradients' fingerprint after the last step
        self._unscaled: dict[int, tuple[bool, tuple[int, ...]]] = {}  # optimizer id -> its check

    def autocast(self, *, device: str | None = None, enabled: bool = True):
        """A context manager: ops inside run in the policy's compute dtype where that is safe."""
        if not enabled:
            return contextlib.nullcontext()
        if device is not None and device != self.device:
            self.ops.check_device(device)
        return self.ops.autocast(self.policy, device or self.device)

    def backward(self, loss: Any, **kwargs) -> None:
        """Backpropagate ``loss * scale``; call once per micro-batch to accumulate gradients."""
        self.backward_tensor(loss).backward(**kwargs)

    def backward_tensor(self, loss: Any) -> Any:
        """``loss * scale``, for a host that runs backward itself (Lightning's and Accelerate's plugins):
        counted as one ``mp.backward``, so the next ``mp.step`` knows its gradients are fresh."""
        self._check_mine(loss, "loss")
        out = self.ops.scale_loss(loss, self.current_scale)
        self._backwards += 1
        return out

    def step(self, optimizer: Any, batch_size: int | None = None, clip_grad_norm: float | None = None
             ) -> StepResult:  # fmt: skip
        """Unscale, check, clip, step or skip, update the scale (see the module docstring).

        ``optimizer`` may be a list: one check over all of them, all step or none, one update.
        ``batch_size`` is for MXNet's ``Trainer.step(batch_size)``.
        """
        optimizers = self._optimizers(optimizer)
        ops = self.ops
        if batch_size is not None and not ops.takes_batch_size:
            raise PolyampError(
                f"batch_size={batch_size!r} is for MXNet's Trainer.step; "
                f"{self.framework} optimizers take none"
            )
        if ops.takes_batch_size and not (is_number(batch_size) and batch_size > 0):
            raise PolyampError(
                "MXNet's Trainer divides the gradients by the batch size: call mp.step(trainer, batch_size) "
                f"with a positive number (1 when the loss is already a mean); got batch_size={batch_size!r}"
            )
        check_clip_norm(clip_grad_norm)
        if self.keep_fp32 and self.policy.compute_dtype != "float32" and not self._kept:
            raise PolyampError(
                f"keep_fp32={self.keep_fp32!r} applies to a model: call mp.watch(model) once before "
                "training, so that those layers compute in float32"
            )
        if self.debug and not self._hooks:
            raise PolyampError(
                "debug=True finds where a NaN/inf first appears through hooks on the model: call "
                "mp.watch(model) once before training (or create the MixedPrecision without debug)"
            )
        ops.check_params(optimizers, self.policy)
        grads, params = ops.gradients(optimizers)
        self._check_fresh(grads)
        done = [self._unscaled[id(opt)] for opt in optimizers if id(opt) in self._unscaled]
        if len(done) < len(optimizers):
            rest = [opt for opt in optimizers if id(opt) not in self._unscaled]
            done.append(self._check(grads if not done else ops.gradients(rest)[0]))
        finite = all(ok for ok, _ in done)
        ranks = tuple(sorted({r for _, rs in done for r in rs}))
        grad_norm = None
        nonfinite: tuple[str, ...] = ()
        if finite:
            if clip_grad_norm is not None:
                grad_norm = ops.clip(grads, params, float(clip_grad_norm))
            ops.apply(optimizers, batch_size)
        else:
            nonfinite = ops.nonfinite([(self._names.get(id(p), f"param[{i}]"), g) for i, (p, g) in
                                       enumerate(zip(params, grads))])  # fmt: skip
        origin = self._origin[0] if self._origin else None
        if origin is None and not nonfinite and ranks:
            origin = f"the gradients of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        self._origin.clear()
        self._unscaled.clear()
        self._backwards = 0
        self._stepped_grads = ops.fingerprint(grads)
        self.state = self.loss_scale.update(self.state, finite)
        self.loss_scale.check(self.state, where=origin, nonfinite=nonfinite)
        return StepResult(finite, self.current_scale, grad_norm, nonfinite, origin, ranks)

    def _unscale_early(self, optimizer: Any) -> bool:
        """Unscale and check ``optimizer``'s gradients before ``step`` (which then uses that check)."""
        optimizers = self._optimizers(optimizer)
        for opt in optimizers:
            if id(opt) in self._unscaled:
                raise PolyampError(
                    f"unscale_() was already called on this {type(opt).__name__} since the last step(); "
                    "its gradients are unscaled: call mp.step(optimizer) next"
                )
        grads, _ = self.ops.gradients(optimizers)
        self._check_fresh(grads)
        checked = self._check(grads)
        for opt in optimizers:
            self._unscaled[id(opt)] = checked
        return checked[0]

    def _optimizers(self, optimizer: Any) -> list:
        """The optimizers of one step (one or a list), checked to be this framework's."""
        optimizers = list(optimizer) if type(optimizer) in (list, tuple) else [optimizer]  # not NamedTuples
        if not optimizers:
            raise PolyampError("step() got an empty list of optimizers")
        for opt in optimizers:
            self._check_mine(opt, "optimizer")
        return optimizers

    def _check(self, grads: list) -> tuple[bool, tuple[int, ...]]:
        """Unscale and check in one pass: (finite on every rank, the ranks that were not)."""
        if not self.guard:
            return True, ()
        return self.ops.unscale_and_check(grads, 1.0 / self.current_scale, self.process_group)

    def _check_fresh(self, grads: list) -> None:
        """PolyampError when the gradients are not new, scaled ones: no backward since the last step
        (a second step would apply them again), or a plain ``loss.backward()`` under a loss scale."""
        if self._backwards or self._unscaled:
            return
        if self.ops.unchanged(grads, self._stepped_grads):
            raise PolyampError(
                "step() was already called since the last backward: these gradients were applied; "
                "call mp.backward(loss) (after optimizer.zero_grad()) before the next mp.step"
            )
        if self.current_scale != 1.0:
            raise PolyampError(
                f"the gradients did not come from mp.backward(loss): they are not multiplied by the "
                f"loss scale ({self.current_scale:g}), and mp.step would divide them by it; call "
                "mp.backward(loss) instead of loss.backward()"
            )

    def watch(self, model: Any) -> Any:
        """Learn the model's parameter names (for ``StepResult.nonfinite``) and, with
        ``debug=True``, record the first module whose output or gradient turns non-finite.

        Under a "true" policy (``bf16-true``, ``fp16-true``: parameters in the low dtype) the
        model's floating parameters are cast to that dtype (in place for torch, as Lightning's
        ``bf16-true`` does), except those of the ``keep_fp32`` layers, which compute in float32
        from here on; the model is returned.
        """
        self._check_mine(model, "model")
        if self.keep_fp32 and self.policy.compute_dtype != "float32":
            self._kept.extend(self.ops.keep_float32(model, self.keep_fp32))
            model = self.ops.prepare_model(model, self.policy, self.keep_fp32)
        else:
            model = self.ops.prepare_model(model, self.policy)
        self._names.update(self.ops.parameter_names(model))
        if self.debug:
            self._hooks.extend(self.ops.watch_nonfinite(model, self._origin))
        return model
