"""What every front end returns and checks: ``StepResult`` and the argument validators.

A leaf module: it imports nothing from polyamp but the errors, so the core and every front end
can use it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .errors import PolyampError


def is_number(value: object) -> bool:
    """A real number that is not a bool (numpy scalars included); NaN is not one."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and value == value


def is_count(value: object, minimum: int) -> bool:
    """An integer (not a bool) >= ``minimum``."""
    integral = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    return integral and value >= minimum


def check_clip_norm(value) -> None:
    """PolyampError unless ``value`` (a gradient-norm clip) is None or a positive real number."""
    if value is not None and not (is_number(value) and value > 0):
        raise PolyampError(f"clip_grad_norm must be a positive number or None, got {value!r}")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did.

    ``scale`` is the loss scale for the next step; ``grad_norm`` the global gradient norm before
    clipping (computed when clipping was asked for); ``nonfinite`` the names of the parameters
    whose gradients held inf/NaN on a skipped step (on this rank); ``origin`` the first module
    whose forward output or gradient became non-finite (with ``debug=True`` and ``watch(model)``);
    ``nonfinite_ranks`` the ranks (replicas) whose gradients were not finite, when distributed.
    """

    stepped: bool
    scale: float
    grad_norm: float | None = None
    nonfinite: tuple[str, ...] = ()
    origin: str | None = None
    nonfinite_ranks: tuple[int, ...] = ()

    # tf.nest protocol, so that a tf.function can return the StepResult of ``mp.apply`` (whose
    # stepped/scale/grad_norm are tensors there); names and the None-ness of grad_norm are static.
    def __tf_flatten__(self):
        values = (self.stepped, self.scale) + (() if self.grad_norm is None else (self.grad_norm,))
        return (self.grad_norm is None, self.nonfinite, self.origin, self.nonfinite_ranks), values

    @classmethod
    def __tf_unflatten__(cls, metadata, values):
        no_norm, nonfinite, origin, ranks = metadata
        return cls(values[0], values[1], None if no_norm else values[2], nonfinite, origin, ranks)
