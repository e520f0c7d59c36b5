"""What the update-ratio and weight-gradient histograms say about low-precision training state.

Per layer, from its update ratios ``r = |u| / 2^b(w)`` (``histogram.py``) in weights with M mantissa bits
(``policy.py``'s ``bf16-true:<rule>``, ``training_state.py``):

- ``nearest`` (plain 16-bit weights) when at most ``limit`` (``recommend.LOST_UPDATES_MAX``) of the
  updates are lost (``r < 2^-(M+1)``, ``predict.lost_updates``);
- else ``sr`` when at most that share is below ``2^-(M+1+SR_BITS)``: stochastic rounding moves a weight by
  a whole ulp with probability ``p = |u| / ulp``, so an update of at least ``2^-SR_BITS`` half-ulps has
  drift ``T p`` against noise ``sqrt(T p)`` after T steps (2.5x after 100 steps at ``p = 1/16``);
- else ``kahan`` when at most that share is below ``2^-(2M+2)``: the compensation ``c`` (itself M bits,
  ``|c| <= ulp(w) / 2``) keeps updates down to half an ulp of ``c``;
- else ``master``: float32 master weights (a ``-mixed`` policy).

The model's rule is the strictest layer's (nearest < sr < kahan < master).

Moments (``states=``), from the weight gradients: Adam's second moment holds ``g^2``, and the 8-bit form
stores each value relative to its block's absmax with 1.6e-7 (half the dynamic map's smallest non-zero
entry, 3.25e-7) as the smallest kept: a ``g^2`` below that flushes to 0 (``|g| < 4e-4 amax``, the
layer's amax standing in for its blocks'). ``int8`` when at most ``limit`` of a layer's non-zero
gradients are that small, else ``bf16`` (float32's range). A one-step gradient is rougher than the moment
(an average over steps), so this errs towards ``bf16``.
"""

from __future__ import annotations

import math

from .histogram import LogHistogram, _edges
from .predict import lost_updates

SR_BITS = 4
INT8_FLOOR = 4.0e-4  # sqrt(1.6e-7): |g| / amax below it flushes g^2 in the 8-bit form
RULES = ("nearest", "sr", "kahan", "master")


def _share_below(hist: LogHistogram, log2_edge: float) -> float:
    """The share of the histogram's elements (all of them, as ``lost_updates``) in bins below ``2^edge``."""
    _, hi = _edges()
    return float(hist.counts[hi <= 2.0**log2_edge].sum()) / hist.total if hist.total else 0.0


def update_rule(ratios: LogHistogram, mbits: int, limit: float) -> tuple[str, dict[str, float]]:
    """The rule for one layer's update ratios in weights of ``mbits`` mantissa bits, and the shares it
    read: ``lost`` (nearest), ``lost_sr``, ``lost_kahan``."""
    shares = {
        "lost": lost_updates(ratios, _format(mbits)).lost,
        "lost_sr": _share_below(ratios, -(mbits + 1 + SR_BITS)),
        "lost_kahan": _share_below(ratios, -(2 * mbits + 2)),
    }
    for rule, key in (("nearest", "lost"), ("sr", "lost_sr"), ("kahan", "lost_kahan")):
        if shares[key] <= limit:
            return rule, shares
    return "master", shares


def strictest(rules) -> str:
    return max(rules, key=RULES.index, default="nearest")


def states_form(grads: LogHistogram, limit: float) -> tuple[str, float]:
    """``int8`` or ``bf16`` for a layer's moments, and the share of its non-zero gradients whose square
    the 8-bit form flushes."""
    if not grads.finite_nonzero or grads.amax == 0:
        return "int8", 0.0
    share = _share_below(grads, math.log2(grads.amax * INT8_FLOOR)) * grads.total / grads.finite_nonzero
    return ("int8" if share <= limit else "bf16"), share


def _format(mbits: int):
    from ..numerics import get_format

    return get_format({7: "bf16", 10: "fp16"}[mbits])
