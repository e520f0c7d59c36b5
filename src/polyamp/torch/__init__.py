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
from .ops import TorchOps


class MixedPrecision(EagerMixedPrecision):
    """Mixed precision for one PyTorch training run (see ``polyamp.MixedPrecision``)."""

    framework = "torch"
    ops = TorchOps()

    def unscale_(self, optimizer: Any) -> bool:
        """Unscale ``optimizer``'s gradients now, so that code can read or change them before
        ``mp.step`` (which then does not unscale them again); returns whether they are finite.

        As ``GradScaler.unscale_``: once per optimizer between two steps.
        """
        return self._unscale_early(optimizer)


__all__ = ["MixedPrecision", "TorchOps"]
