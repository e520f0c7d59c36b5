"""The backward chain: the rounding noise a low-precision backward pass carries into each gradient.

In a run whose backward pass computes in a format, a layer's output gradient is computed from the later
layers' gradients, each already rounded to the format. Model (each gradient's flush is then
``predict(..., noise=R)``):
- rounding a gradient to the format below its min_normal (flushed and subnormal elements: errors up to
  half the subnormal step, absolute) adds noise of relative power ``rho = that error's energy / the
  signal energy`` (``Prediction.underflow_noise``). Rounding normal values adds relative error of the
  order of 2^-(M+1) per value, which stays with values of that size and is left out;
- a backward map carries noise and signal alike, so relative powers add up along the chain: the output
  gradient of layer ``l`` carries, before its own rounding, ``R_l = sum of rho`` over the output gradients
  of the layers after ``l``; its weight gradient also that of its own output gradient.
Layer order is the observations' (the forward order), so every later layer counts as upstream: parallel
branches (attention's q, k, v) are summed as if in series, which overstates their noise. Only the flush
prediction uses it: noise lifts small gradients off zero (and pushes a few onto it), which a cast of the
float32 gradients cannot show; with every gradient normal (a working loss scale) ``R`` is 0.
"""

from __future__ import annotations

from ..numerics import FloatFormat
from .histogram import LogHistogram
from .predict import Prediction, predict


def backward_noise(table: dict[str, dict[str, LogHistogram]], fmt: FloatFormat, scale: float
                   ) -> dict[tuple[str, str], float]:  # fmt: skip
    """``R`` per (layer, gradient kind) for gradients multiplied by ``scale`` and rounded to ``fmt``;
    ``table``: layer -> kind -> histogram, layers in forward order."""
    out, upstream = {}, 0.0
    for layer in reversed(list(table)):
        g = table[layer].get("grad_output")
        own = predict(g, fmt, scale).underflow_noise if g is not None and g.total else 0.0
        out[layer, "grad_output"] = upstream
        out[layer, "grad_weight"] = upstream + own
        upstream += own
    return out


def gradient_predictions(table, fmt: FloatFormat, scale: float) -> dict[tuple[str, str], Prediction]:
    """Every gradient of ``table`` predicted in ``fmt`` at ``scale`` with its backward noise."""
    noise = backward_noise(table, fmt, scale)
    return {(layer, kind): predict(h, fmt, scale, noise[layer, kind])
            for layer, kinds in table.items() for kind, h in kinds.items()
            if kind in ("grad_output", "grad_weight") and h.total}  # fmt: skip
