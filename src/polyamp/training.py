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
from dataclasses import dataclass
from typing import Any

from .backends import detect, get_backend, imported_frameworks
from .errors import PolyampError
from .policy import Policy
from .scaling import DynamicLossScale, NoLossScale, StaticLossScale, _number


def check_clip_norm(value) -> None:
    """PolyampError unless ``value`` (a gradient-norm clip) is None or a positive real number."""
    if value is not None and not (_number(value) and value > 0):
        raise PolyampError(f"clip_grad_norm must be a positive number or None, got {value!r}")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    ``scale`` is the loss scale for the next step; ``grad_norm`` the global gradient norm before
    clipping (computed when clipping was asked for); ``nonfinite`` the names of the parameters
    whose gradients held inf/NaN on a skipped step; ``origin`` the first module whose forward
    output or gradient became non-finite (with ``debug=True`` and ``watch(model)``).
    """

    stepped: bool
    scale: float
    grad_norm: float | None = None
    nonfinite: tuple[str, ...] = ()
    origin: str | None = None

    # tf.nest protocol, so that a tf.function can return the StepResult of ``mp.apply`` (whose
    # stepped/scale/grad_norm are tensors there); names and the None-ness of grad_norm are static.
    def __tf_flatten__(self):
        values = (self.stepped, self.scale) + (() if self.grad_norm is None else (self.grad_norm,))
        return (self.grad_norm is None, self.nonfinite, self.origin), values

    @classmethod
    def __tf_unflatten__(cls, metadata, values):
        no_norm, nonfinite, origin = metadata
        return cls(values[0], values[1], None if no_norm else values[2], nonfinite, origin)


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
    if all(hasattr(spec, attr) for attr in ("init", "update", "check")):
        return spec
    raise PolyampError(
        f"unknown loss_scale {spec!r}; accepted: None, 'dynamic', 'none', a preset name "
        "('polyamp', 'torch', 'keras', 'jmp', 'deepspeed', 'mxnet'), a number, or a loss-scale object"
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
        if self.framework is None:
            found = imported_frameworks()
            if len(found) != 1:
                raise PolyampError(
                    "cannot tell which framework this MixedPrecision drives "
                    f"(imported: {', '.join(found) or 'none'}); pass framework='torch' (or "
                    "'tensorflow', 'jax', 'mxnet')"
                )
            self.framework = found[0]
        return get_backend(self.framework)

    def _bind(self, obj: Any, what: str):
        name = detect(obj)
        if name is None:
            raise PolyampError(
                f"{what} must be a tensor/model/optimizer of a supported framework, got "
                f"{type(obj).__module__}.{type(obj).__name__}"
            )
        if self.framework is None:
            self.framework = name
        elif name != self.framework:
            raise PolyampError(
                f"this MixedPrecision drives {self.framework}, but {what} is a {name} object "
                f"({type(obj).__module__}.{type(obj).__name__}); use one MixedPrecision per framework"
            )
        return get_backend(name)

    def _use(self, name: str):
        """Bind to a framework by name, for idioms that are handed no framework object."""
        if self.framework is None:
            get_backend(name)  # validates the name and that it is installed
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
        return self.backend.autocast(self.policy, device or self.device)

    def backward(self, loss: Any, **kwargs) -> None:
        """Backpropagate ``loss * scale``; call once per micro-batch to accumulate gradients."""
        backend = self._bind(loss, "loss")
        backend.scale_loss(loss, self.current_scale).backward(**kwargs)

    def step(self, optimizer: Any, batch_size: int | None = None, clip_grad_norm: float | None = None
             ) -> StepResult:  # fmt: skip
        """Unscale, check, clip, step or skip, update the scale (see the module docstring).

        ``optimizer`` may be a list: one check over all of them, all step or none, one update.
        ``batch_size`` is for MXNet's ``Trainer.step(batch_size)``.
        """
        optimizers = list(optimizer) if type(optimizer) in (list, tuple) else [optimizer]  # not NamedTuples
        if not optimizers:
            raise PolyampError("step() got an empty list of optimizers")
        backend = self._bind(optimizers[0], "optimizer")
        for opt in optimizers[1:]:
            self._bind(opt, "optimizer")
        if batch_size is not None and not backend.takes_batch_size:
            raise PolyampError(
                f"batch_size={batch_size!r} is for MXNet's Trainer.step; "
                f"{self.framework} optimizers take none"
            )
        if backend.takes_batch_size and not (_number(batch_size) and batch_size > 0):
            raise PolyampError(
                "MXNet's Trainer divides the gradients by the batch size: call mp.step(trainer, batch_size) "
                f"with a positive number (1 when the loss is already a mean); got batch_size={batch_size!r}"
            )
        check_clip_norm(clip_grad_norm)
        grads, params = backend.gradients(optimizers)
        finite = True
        if self.guard:
            finite = backend.unscale_and_check(grads, 1.0 / self.current_scale, self.process_group)
        grad_norm = None
        nonfinite: tuple[str, ...] = ()
        if finite:
            if clip_grad_norm is not None:
                grad_norm = backend.clip(grads, params, float(clip_grad_norm))
            backend.apply(optimizers, batch_size)
        else:
            nonfinite = backend.nonfinite([(self._name(p, i), g) for i, (p, g) in
                                           enumerate(zip(params, grads))])  # fmt: skip
        origin = self._origin[0] if self._origin else (nonfinite[0] if nonfinite else None)
        self._origin.clear()
        self.state = self.loss_scale.update(self.state, finite)
        self.loss_scale.check(self.state, where=origin)
        return StepResult(finite, self.current_scale, grad_norm, nonfinite, origin)

    def watch(self, model: Any) -> Any:
        """Learn the model's parameter names (for ``StepResult.nonfinite``) and, with
        ``debug=True``, record the first module whose output or gradient turns non-finite."""
        backend = self._bind(model, "model")
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
        return self._bind(trainer, "trainer").scale_loss_context(self, loss, trainer)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Policy, loss-scale configuration and state, as plain Python values."""
        return {
            "policy": self.policy.name,
            "loss_scale": self.loss_scale.as_dict(),
            "state": self.loss_scale.state_dict(self.state),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the loss-scale state saved by ``state_dict``."""
        if not isinstance(state, dict) or "state" not in state or "policy" not in state:
            raise PolyampError(
                f"expected a dict from MixedPrecision.state_dict(), got {type(state).__name__}"
            )
        if Policy.parse(state["policy"]) != self.policy:
            raise PolyampError(
                f"the checkpoint was saved with policy {state['policy']!r}, this run uses "
                f"{self.policy.name!r}; create MixedPrecision({state['policy']!r}) to resume it"
            )
        self.state = self.loss_scale.load_state(state["state"])

    def __repr__(self) -> str:
        return (f"MixedPrecision({self.policy.name!r}, framework={self.framework!r}, "
                f"scale={self.current_scale:g})")  # fmt: skip
