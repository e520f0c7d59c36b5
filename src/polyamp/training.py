"""``MixedPrecision``: one object per training run, in each framework's idiom.

The step sequence is written once here; backends supply the primitives (``backends/_base.py``):

1. unscale the gradients by ``1/scale`` and check them for inf/NaN in one fused pass;
2. agree on the finite flag across ranks (all-reduce) when training is distributed;
3. if finite: clip by global norm (optional) and run the optimizers; else skip them;
4. update the loss scale (``scaling.py``); after too many consecutive skips raise
   ``NonFiniteError`` naming where the first non-finite value came from.

Every policy guards the update: a non-finite step is skipped also when no loss scaling is needed
(bf16, fp32), unless ``guard=False``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from .backends import canonical_framework, detect, get_backend, imported_frameworks
from .errors import PolyampError
from .native import from_native, to_native
from .policy import Policy
from .scaling import PRESETS, DynamicLossScale, NoLossScale, StaticLossScale, check_loss_scale
from .step import StepResult, check_clip_norm, is_number


def make_loss_scale(spec, policy: Policy):
    """None: dynamic (polyamp defaults) when the policy needs scaling, else none; a preset name;
    a number (static); or a loss-scale object."""
    if spec is None:
        return DynamicLossScale() if policy.needs_loss_scaling else NoLossScale()
    if isinstance(spec, str):
        if spec in ("none", "off"):
            return NoLossScale()
        return DynamicLossScale() if spec == "dynamic" else DynamicLossScale.preset(spec)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return StaticLossScale(float(spec))
    if any(hasattr(spec, member) for member in ("init", "update", "update_arrays")):
        return check_loss_scale(spec)
    raise PolyampError(
        f"unknown loss_scale {spec!r}; accepted: None, 'dynamic', 'none', a preset name "
        f"({', '.join(map(repr, PRESETS))}), a number, or a loss-scale object (polyamp.scaling.LossScale)"
    )


class MixedPrecision:
    """Mixed precision for one training run.

    >>> mp = MixedPrecision("bf16-mixed")          # doctest: +SKIP
    >>> with mp.autocast():                         # doctest: +SKIP
    ...     loss = loss_fn(model(x), y)
    >>> mp.backward(loss)                           # doctest: +SKIP
    >>> result = mp.step(optimizer, clip_grad_norm=1.0)  # doctest: +SKIP

    ``framework`` is inferred from the first tensor, model or optimizer handed over, or named.
    ``device`` is the autocast device ('cpu', 'cuda'; default: cuda when available, else cpu).
    ``process_group`` is the group whose ranks must agree on skipping (default: the world).
    """

    # Where a backend keeps the loss-scale state in framework variables (TensorFlow: tf.Variables
    # updated inside tf.function), an object with read() -> LossScaleState and write(state).
    _state_store: Any = None

    def __init__(self, policy: str | Policy = "bf16-mixed", *, loss_scale=None,
                 framework: str | None = None, device: str | None = None, guard: bool = True,
                 debug: bool = False, process_group: Any = None):  # fmt: skip
        self.policy = Policy.parse(policy)
        self.loss_scale = make_loss_scale(loss_scale, self.policy)
        for name, value in (("guard", guard), ("debug", debug)):
            if not isinstance(value, bool):
                raise PolyampError(f"{name} must be True or False; received {value!r}")
        if device is not None and not isinstance(device, str):
            raise PolyampError(f"device must be a string such as 'cpu' or 'cuda:0', or None; "
                               f"received {device!r}")  # fmt: skip
        if not guard and not isinstance(self.loss_scale, NoLossScale):
            raise PolyampError(
                "guard=False needs loss_scale='none': a loss scale needs the finite check to adapt"
            )
        self.state = self.loss_scale.init()
        self.framework = None
        self.device = device
        self.guard = guard
        self.debug = debug
        self.process_group = process_group
        self._names: dict[int, str] = {}
        self._origin: list[str] = []
        self._hooks: list[Any] = []
        self._backwards = 0  # mp.backward / scale_loss calls since the last step
        self._stepped_grads: Any = None  # the gradients' fingerprint after the last step
        self._unscaled: dict[int, tuple[bool, tuple[int, ...]]] = {}  # optimizer id -> its check
        if framework is not None:
            self._use(framework).attach(self)  # MXNet: amp.init, before the network is built

    @property
    def state(self):
        """The loss-scale state (a ``LossScaleState``); read from the backend's variables, if any."""
        return self._state if self._state_store is None else self._state_store.read()

    @state.setter
    def state(self, value) -> None:
        self._state = value
        if self._state_store is not None:
            self._state_store.write(value)

    # -- which framework ---------------------------------------------------------------------------
    @property
    def backend(self):
        return self._guess(imported_frameworks())

    def _guess(self, candidates: list[str]):
        """The bound framework's backend, or bind the only candidate."""
        if self.framework is None:
            if len(candidates) != 1:
                raise PolyampError(
                    "cannot tell which framework this MixedPrecision drives "
                    f"(imported: {', '.join(imported_frameworks()) or 'none'}); pass framework='torch' "
                    "(or 'tensorflow', 'jax', 'mxnet'), or hand it a model first (mp.watch(model))"
                )
            return self._use(candidates[0])
        return get_backend(self.framework)

    def _bind(self, obj: Any, what: str):
        name = detect(obj)
        if name is None:
            raise PolyampError(
                f"{what} must be a tensor/model/optimizer of a supported framework, got "
                f"{type(obj).__module__}.{type(obj).__name__}"
            )
        if self.framework is not None and name != self.framework:
            raise PolyampError(
                f"this MixedPrecision drives {self.framework}, but {what} is a {name} object "
                f"({type(obj).__module__}.{type(obj).__name__}); use one MixedPrecision per framework"
            )
        return self._use(name)

    def _use(self, name: str):
        """Bind to a framework by name, for idioms that are handed no framework object."""
        name = canonical_framework(name)
        if self.framework is None:
            get_backend(name).check_device(self.device)  # validates the name, install and device
            self.framework = name
        elif self.framework != name:
            raise PolyampError(
                f"this MixedPrecision drives {self.framework}; that call is {name}'s idiom. "
                "Use one MixedPrecision per framework"
            )
        return get_backend(name)

    @property
    def current_scale(self) -> float:
        """The loss scale the next backward pass multiplies by."""
        return float(self.state.scale)

    # -- the eager (PyTorch, MXNet) idiom ------------------------------------------------------------
    def autocast(self, fn=None, *, device: str | None = None, enabled: bool = True, rules: Any = None):
        """Ops in the policy's compute dtype where that is safe.

        Without ``fn``: a context manager (PyTorch, MXNet). With a function (JAX): the function
        rewritten so its matmuls and convolutions run in the compute dtype; ``rules`` (JAX only)
        is an ``AutocastRules`` table (``polyamp.backends.jax_autocast``).
        """
        if fn is not None:
            return self._use("jax").autocast_fn(self, fn, enabled=enabled, rules=rules)
        if rules is not None:
            raise PolyampError("rules= applies to JAX's mp.autocast(fn); pass the function to rewrite")
        if not enabled:
            return contextlib.nullcontext()
        # the context form is the torch and MXNet idiom: with TF or JAX also imported, it is theirs
        backend = self._guess([f for f in imported_frameworks() if f in ("torch", "mxnet")])
        if device is not None and device != self.device:
            backend.check_device(device)
        return backend.autocast(self.policy, device or self.device)

    def backward(self, loss: Any, **kwargs) -> None:
        """Backpropagate ``loss * scale``; call once per micro-batch to accumulate gradients."""
        backend = self._bind(loss, "loss")
        backend.scale_loss(loss, self.current_scale).backward(**kwargs)
        self._backwards += 1

    def unscale_(self, optimizer: Any) -> bool:
        """Unscale ``optimizer``'s gradients now, so that code can read or change them before
        ``mp.step`` (which then does not unscale them again); returns whether they are finite.

        As ``GradScaler.unscale_``: once per optimizer between two steps.
        """
        optimizers, backend = self._optimizers(optimizer)
        if not backend.early_unscale:
            raise PolyampError(f"unscale_() is the torch idiom; the {backend.name} step unscales in mp.step")
        for opt in optimizers:
            if id(opt) in self._unscaled:
                raise PolyampError(
                    f"unscale_() was already called on this {type(opt).__name__} since the last step(); "
                    "its gradients are unscaled: call mp.step(optimizer) next"
                )
        grads, _ = backend.gradients(optimizers)
        self._check_fresh(backend, grads)
        checked = self._check(backend, grads)
        for opt in optimizers:
            self._unscaled[id(opt)] = checked
        return checked[0]

    def step(self, optimizer: Any, batch_size: int | None = None, clip_grad_norm: float | None = None
             ) -> StepResult:  # fmt: skip
        """Unscale, check, clip, step or skip, update the scale (see the module docstring).

        ``optimizer`` may be a list: one check over all of them, all step or none, one update.
        ``batch_size`` is for MXNet's ``Trainer.step(batch_size)``.
        """
        optimizers, backend = self._optimizers(optimizer)
        if batch_size is not None and not backend.takes_batch_size:
            raise PolyampError(
                f"batch_size={batch_size!r} is for MXNet's Trainer.step; "
                f"{self.framework} optimizers take none"
            )
        if backend.takes_batch_size and not (is_number(batch_size) and batch_size > 0):
            raise PolyampError(
                "MXNet's Trainer divides the gradients by the batch size: call mp.step(trainer, batch_size) "
                f"with a positive number (1 when the loss is already a mean); got batch_size={batch_size!r}"
            )
        check_clip_norm(clip_grad_norm)
        if self.debug and not self._hooks:
            raise PolyampError(
                "debug=True finds where a NaN/inf first appears through hooks on the model: call "
                "mp.watch(model) once before training (or create the MixedPrecision without debug)"
            )
        backend.check_params(optimizers, self.policy)
        grads, params = backend.gradients(optimizers)
        self._check_fresh(backend, grads)
        done = [self._unscaled[id(opt)] for opt in optimizers if id(opt) in self._unscaled]
        if len(done) < len(optimizers):
            rest = [opt for opt in optimizers if id(opt) not in self._unscaled]
            done.append(self._check(backend, grads if not done else backend.gradients(rest)[0]))
        finite = all(ok for ok, _ in done)
        ranks = tuple(sorted({r for _, rs in done for r in rs}))
        grad_norm = None
        nonfinite: tuple[str, ...] = ()
        if finite:
            if clip_grad_norm is not None:
                grad_norm = backend.clip(grads, params, float(clip_grad_norm))
            backend.apply(optimizers, batch_size)
        else:
            nonfinite = backend.nonfinite([(self._name(p, i), g) for i, (p, g) in
                                           enumerate(zip(params, grads))])  # fmt: skip
        origin = self._origin[0] if self._origin else None
        if origin is None and not nonfinite and ranks:
            origin = f"the gradients of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        self._origin.clear()
        self._unscaled.clear()
        self._backwards = 0
        self._stepped_grads = backend.fingerprint(grads)
        self.state = self.loss_scale.update(self.state, finite)
        self.loss_scale.check(self.state, where=origin, nonfinite=nonfinite)
        return StepResult(finite, self.current_scale, grad_norm, nonfinite, origin, ranks)

    def _optimizers(self, optimizer: Any) -> tuple[list, Any]:
        """The optimizers of one step (one or a list) and their backend."""
        optimizers = list(optimizer) if type(optimizer) in (list, tuple) else [optimizer]  # not NamedTuples
        if not optimizers:
            raise PolyampError("step() got an empty list of optimizers")
        backend = self._bind(optimizers[0], "optimizer")
        for opt in optimizers[1:]:
            self._bind(opt, "optimizer")
        return optimizers, backend

    def _check(self, backend, grads: list) -> tuple[bool, tuple[int, ...]]:
        """Unscale and check in one pass: (finite on every rank, the ranks that were not)."""
        if not self.guard:
            return True, ()
        return backend.unscale_and_check(grads, 1.0 / self.current_scale, self.process_group)

    def _check_fresh(self, backend, grads: list) -> None:
        """PolyampError when the gradients are not new, scaled ones: no backward since the last step
        (a second step would apply them again), or a plain ``loss.backward()`` under a loss scale."""
        if self._backwards or self._unscaled:
            return
        if backend.unchanged(grads, self._stepped_grads):
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
        ``bf16-true`` does); the model is returned.
        """
        backend = self._bind(model, "model")
        model = backend.prepare_model(model, self.policy)
        self._names.update(backend.parameter_names(model))
        if self.debug:
            self._hooks.extend(backend.watch_nonfinite(model, self._origin))
        return model

    def _name(self, param: Any, index: int) -> str:
        return self._names.get(id(param), f"param[{index}]")

    # -- the Keras / TensorFlow idiom (backends/tensorflow.py) --------------------------------------
    def scope(self):
        """Context manager: Keras layers built inside it take the policy's dtype policy."""
        return self._use("tensorflow").scope(self)

    def optimizer(self, optimizer: Any):
        """A Keras optimizer for ``compile``/``fit`` that scales, checks and skips as polyamp does."""
        return self._bind(optimizer, "optimizer").wrap_optimizer(self, optimizer)

    def callback(self):
        """A Keras ``fit`` callback that adds ``loss_scale`` and ``skipped_steps`` to the logs
        (so to ``History`` and TensorBoard): ``model.fit(..., callbacks=[mp.callback()])``."""
        return self._use("tensorflow").callback(self)

    def scale(self, loss: Any):
        """``loss * scale`` for a custom ``GradientTape`` loop (usable inside ``tf.function``)."""
        return self._bind(loss, "loss").scale(self, loss)

    def apply(self, optimizer: Any, grads: Any, variables: Any, clip_grad_norm: float | None = None):
        """Unscale, check, clip, apply or skip, update the scale; returns a ``StepResult``."""
        backend = self._bind(optimizer, "optimizer")
        return backend.apply_gradients(self, optimizer, grads, variables, clip_grad_norm)

    # -- the JAX idiom (backends/jax.py): functional, state passed in and out --------------------
    def init(self):
        """The loss-scale state as a pytree, to thread through a jitted train step."""
        return self._use("jax").init_state(self)

    def grad(self, fn, **kwargs):
        """Like ``jax.grad`` of a scalar loss, returning ``(grads, finite, new_state)``."""
        return self._use("jax").grad(self, fn, **kwargs)

    def value_and_grad(self, fn, **kwargs):
        """Like ``jax.value_and_grad``, returning ``((value, grads), finite, new_state)``."""
        return self._use("jax").value_and_grad(self, fn, **kwargs)

    def sync(self, state):
        """Adopt a JAX loss-scale state (from ``init``/``grad``) as ``self.state``, so that
        ``state_dict()`` and ``current_scale`` reflect it; raises ``NonFiniteError`` after too many
        consecutive skipped steps. One small device-to-host transfer."""
        return self._use("jax").sync(self, state)

    # -- the MXNet Gluon idiom (backends/mxnet.py) -------------------------------------------------
    def trainer(self, trainer: Any):
        """Prepare a ``gluon.Trainer`` for loss scaling (it must not update on the kvstore)."""
        return self._bind(trainer, "trainer").wrap_trainer(self, trainer)

    def scale_loss(self, loss: Any, trainer: Any):
        """Context manager yielding ``loss * scale`` (a list for a list of losses) to backpropagate."""
        context = self._bind(trainer, "trainer").scale_loss_context(self, loss, trainer)
        self._backwards += 1
        return context

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self, native: str | None = None) -> Any:
        """Policy, loss-scale configuration and state, as plain Python values; with ``native``
        (``"torch"``, ``"keras"``, ``"jmp"``, ``"deepspeed"``, ``"deepspeed-fp16"``) the loss-scale
        state in that library's own form instead (``polyamp.native.to_native``)."""
        if native is not None:
            return to_native(self.loss_scale, self.state, native)
        return {
            "policy": self.policy.name,
            "loss_scale": self.loss_scale.as_dict(),
            "state": self.loss_scale.state_dict(self.state),
        }

    def load_state_dict(self, state: Any) -> None:
        """Restore the loss-scale state saved by ``state_dict``, or by a native scaler (a torch
        ``GradScaler`` or its state dict, a Keras ``LossScaleOptimizer``, a jmp
        ``DynamicLossScale``, a DeepSpeed scaler state; see ``polyamp.native``).

        This run's loss-scale settings are kept (``GradScaler`` adopts the saved ones instead);
        a RuntimeWarning names the settings that differ from the checkpoint's.
        """
        if not (isinstance(state, dict) and "state" in state and "policy" in state):
            if not isinstance(self.loss_scale, DynamicLossScale):
                raise PolyampError(
                    f"a native loss-scaler checkpoint holds a dynamic loss scale, but this run has "
                    f"{type(self.loss_scale).__name__} (policy {self.policy.name!r}); expected a dict "
                    f"from MixedPrecision.state_dict(), got {type(state).__name__}"
                )
            config, new_state = from_native(state)
            _warn_if_config_differs(config.as_dict(), self.loss_scale)
            self.state = new_state
            return
        if Policy.parse(state["policy"]) != self.policy:
            raise PolyampError(
                f"the checkpoint was saved with policy {state['policy']!r}, this run uses "
                f"{self.policy.name!r}; create MixedPrecision({state['policy']!r}) to resume it"
            )
        new_state = self.loss_scale.load_state(state["state"])
        _warn_if_config_differs(state.get("loss_scale"), self.loss_scale)
        self.state = new_state

    def __repr__(self) -> str:
        return (f"MixedPrecision({self.policy.name!r}, framework={self.framework!r}, "
                f"scale={self.current_scale:g})")  # fmt: skip


def _warn_if_config_differs(saved: Any, loss_scale: Any) -> None:
    """Resuming keeps this run's loss-scale settings (GradScaler adopts the saved ones): say so
    when they differ from the checkpoint's."""
    ours = loss_scale.as_dict() if hasattr(loss_scale, "as_dict") else None
    if not isinstance(saved, dict) or not isinstance(ours, dict) or saved == ours:
        return
    changed = [f"{k}={saved.get(k)!r} -> {ours.get(k)!r}" for k in sorted(set(saved) | set(ours))
               if saved.get(k) != ours.get(k)]  # fmt: skip
    warnings.warn(
        "the checkpoint's loss-scale settings differ from this run's; the saved state (scale, "
        f"counters) is restored and this run's settings are kept: {', '.join(changed)}",
        RuntimeWarning,
        stacklevel=3,
    )
