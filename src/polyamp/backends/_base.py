"""The contract every framework backend implements.

A backend supplies the few framework-specific primitives; the training sequence (unscale ->
finite check -> clip -> step or skip -> loss-scale update) is written once in ``training.py``.
A method a framework cannot support raises ``PolyampError`` saying so (the base versions do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import PolyampError


class Backend:
    """Framework adapter. Subclasses set ``name`` and override what their framework supports."""

    name = "?"
    takes_batch_size = False  # whether the optimizer step needs the batch size (MXNet's Trainer)
    early_unscale = False  # whether mp.unscale_(optimizer) may run before mp.step (torch)

    def _unsupported(self, what: str) -> PolyampError:
        return PolyampError(f"{what} is not supported by the {self.name} backend")

    def check_device(self, device: str | None) -> None:
        """PolyampError unless ``device`` names a device this framework can autocast on."""

    def check_params(self, optimizers: Sequence[Any], policy) -> None:
        """PolyampError when the parameters are not in the policy's parameter dtype."""

    def prepare_model(self, model: Any, policy) -> Any:
        """The model with its parameters in the policy's parameter dtype (``mp.watch``)."""
        return model

    def fingerprint(self, grads: list[Any]) -> Any:
        """Something that tells these gradient tensors, unchanged, from any later ones."""
        return None

    def unchanged(self, grads: list[Any], fingerprint: Any) -> bool:
        """True when ``grads`` are the very tensors, unmodified, that ``fingerprint`` was taken of."""
        return False

    def attach(self, mp) -> None:
        """Called when a ``MixedPrecision`` is created for this framework by name (MXNet sets up
        its process-wide AMP here, before the network is built)."""

    # -- the training step --------------------------------------------------------------------------
    def autocast(self, policy, device: str | None):
        """A context manager running ops in the policy's compute dtype."""
        raise self._unsupported("autocast")

    def scale_loss(self, loss: Any, scale: float) -> Any:
        """``loss * scale``, after checking that ``loss`` is a floating scalar."""
        raise self._unsupported("scale_loss")

    def gradients(self, optimizers: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(gradients, their parameters) that the optimizers will apply, validated."""
        raise self._unsupported("gradients")

    def unscale_and_check(self, grads: list[Any], inv_scale: float, group: Any = None
                          ) -> tuple[bool, tuple[int, ...]]:  # fmt: skip
        """Multiply grads by ``inv_scale`` in place; (True when all are finite on every rank, the
        ranks whose gradients were not).

        One fused pass over the gradients and one host synchronisation; the flag is all-reduced
        across the distributed group when one is active.
        """
        raise self._unsupported("unscale_and_check")

    def clip(self, grads: list[Any], params: list[Any], max_norm: float) -> float:
        """Clip by global norm; returns the norm before clipping."""
        raise self._unsupported("clip")

    def nonfinite(self, named_grads: list[tuple[str, Any]]) -> tuple[str, ...]:
        """Names of the gradients that hold inf or NaN (only called after a failed check)."""
        raise self._unsupported("nonfinite")

    def apply(self, optimizers: Sequence[Any], batch_size: int | None = None) -> None:
        """Run the optimizers' update (``batch_size``: MXNet's ``Trainer.step`` argument)."""
        raise self._unsupported("apply")

    # -- framework idioms: MixedPrecision delegates to these (see training.py) -----------------
    # Keras / TensorFlow
    def scope(self, mp):
        raise self._unsupported("scope() (the Keras idiom)")

    def wrap_optimizer(self, mp, optimizer):
        raise self._unsupported("optimizer() (the Keras idiom)")

    def scale(self, mp, loss):
        raise self._unsupported("scale(loss) (the Keras custom-loop idiom)")

    def apply_gradients(self, mp, optimizer, grads, variables, clip_grad_norm):
        raise self._unsupported("apply(optimizer, grads, variables) (the Keras custom-loop idiom)")

    # JAX
    def autocast_fn(self, mp, fn, enabled: bool = True, rules=None):
        raise self._unsupported("autocast(fn) (the JAX idiom)")

    def init_state(self, mp):
        raise self._unsupported("init() (the JAX idiom)")

    def grad(self, mp, fn, **kwargs):
        raise self._unsupported("grad(fn) (the JAX idiom)")

    def value_and_grad(self, mp, fn, **kwargs):
        raise self._unsupported("value_and_grad(fn) (the JAX idiom)")

    def sync(self, mp, state):
        raise self._unsupported("sync(state) (the JAX idiom)")

    # MXNet Gluon
    def wrap_trainer(self, mp, trainer):
        raise self._unsupported("trainer() (the MXNet idiom)")

    def scale_loss_context(self, mp, loss, trainer):
        raise self._unsupported("scale_loss(loss, trainer) (the MXNet idiom)")

    # -- names and debugging --------------------------------------------------------------------
    def parameter_names(self, model: Any) -> dict[int, str]:
        """``id(parameter) -> qualified name`` for a model."""
        raise self._unsupported("parameter_names")

    def watch_nonfinite(self, model: Any, origin: list[str]) -> list[Any]:
        """Install hooks that append to ``origin`` where a non-finite value first appears
        (forward output or gradient); returns handles that remove them."""
        raise self._unsupported("watch_nonfinite")
