"""Deprecated alias: ``MixedPrecision`` and ``make_loss_scale`` live in ``polyamp.mixed_precision``
(the eager step in ``polyamp.eager``; docs/ARCHITECTURE.md)."""

import warnings

from .mixed_precision import MixedPrecision, make_loss_scale

__all__ = ["MixedPrecision", "make_loss_scale"]

warnings.warn("polyamp.training moved to polyamp.mixed_precision", DeprecationWarning, stacklevel=2)
