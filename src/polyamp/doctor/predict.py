"""What a cast to a format would do to a tensor, predicted from its LogHistogram alone.

Rules (each stated once; ``v = scale * |x|``, rounded as ``polyamp.numerics.quantize``, nearest-even):

- Regions, for a format with M mantissa bits, step ``s = 2^(emin - M)`` and top spacing ``Q = 2^(emax - M)``:
  flush ``v <= smallest_positive / 2`` (rounds to 0; a format without zero never flushes, it clamps to
  min_normal); subnormal ``flush < v < min_normal - s/2`` (a non-zero subnormal result); overflow
  ``v >= max + Q/2`` (to inf/NaN, or to max where the format saturates; the tie itself overflows only
  when max's significand is odd: ieee yes, fn no); normal otherwise. Signs play no part (an unsigned
  format's NaN for negative input is not predicted).
- Linear split: a bin's count is spread uniformly over its edges, clipped to [amin_nonzero, amax] and
  multiplied by the scale; a region gets the overlap length / width. The below and above bins are point
  masses at amin_nonzero (2^(B_MIN-1) when unknown) and at amax. A power-of-two scale maps bin edges onto
  bin edges, so the power-of-two thresholds (the flush limit, min_normal) split no bin: flush is exact
  (up to a tie on the edge itself); ``min_normal - s/2`` and ``max + Q/2`` each split one sub-bin.
- Exact extremes: no element overflows when ``amax * scale`` does not, none flushes when
  ``amin_nonzero * scale`` does not; when it does, at least one element is counted.
- Rounding error, over elements finite, non-zero and not overflowing: in binade e the grid is the
  multiples of ``q = 2^(max(e, emin) - M)``, so the squared error over a uniform piece integrates
  exactly (``_grid_sq``); a flushed element has relative error 1. ``rel_rms_error`` is
  sqrt(mean(((q(x) - x) / x)^2)), taking each piece [a, b)'s mean of d^2 / x^2 as E[d^2] / (a b);
  ``sqnr_db`` is 10 log10(sum x^2 / sum (q(x) - x)^2).
- Every fraction is of ``total`` (all elements, zeros and non-finite included).
- Backward noise (``noise`` > 0, for a gradient computed by a backward pass in the format: ``chain.py``):
  before its own rounding, each non-zero element carries zero-mean Gaussian noise of variance
  ``noise * mean(v^2)``, and it flushes when ``|v + noise|`` does: per uniform piece [a, b) that is
  ``sigma / (b - a) * [G((t - a) / s) - G((t - b) / s) - G((-t - a) / s) + G((-t - b) / s)]`` with
  ``G(z) = z Phi(z) + phi(z)`` (the integral of the normal CDF), ``t`` the flush limit and ``s`` = sigma.
  Only ``flush`` moves (elements lifted off zero land subnormal; ``subnormal`` gives back what ``flush``
  gains); the rounding error stays the cast's; the exact-extremes floor of one element still holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import PolyampError
from ..numerics import FloatFormat, get_format, quantize
from .histogram import ABOVE, B_MIN, BELOW, HI, LO, SUB, LogHistogram

SCALED_FORMATS = ("fp16", "e5m2")  # formats whose gradients are run under a loss scale


@dataclass(frozen=True)
class Prediction:
    """Fractions of ``total`` elements per outcome of casting ``scale * x`` to ``format``."""

    format: str
    scale: float
    total: int
    overflow: float
    flush: float
    subnormal: float
    normal: float
    zeros: float
    nonfinite: float
    any_overflow: bool
    any_flush: bool
    rel_rms_error: float
    sqnr_db: float  # inf when nothing is rounded
    underflow_noise: float  # the squared error of flushed and subnormal elements / signal energy

    def to_json(self) -> dict:
        out = asdict(self)
        out["sqnr_db"] = self.sqnr_db if math.isfinite(self.sqnr_db) else None
        return out


@dataclass(frozen=True)
class LostUpdates:
    """Fractions of ``total`` update elements, for weights stored in ``format``."""

    format: str
    total: int
    lost: float  # non-zero update below half an ulp of its weight: adding it leaves the weight unchanged
    zero_update: float
    zero_weight: float
    nonfinite: float

    @property
    def unchanged(self) -> float:
        """Weights a step leaves as they were: lost updates plus zero updates."""
        return self.lost + self.zero_update

    def to_json(self) -> dict:
        return {**asdict(self), "unchanged": self.unchanged}


@dataclass(frozen=True)
class _Limits:
    flush: float  # v <= flush rounds to 0
    sub: float  # flush < v < sub lands subnormal
    over: float  # v >= over overflows (the tie only when tie_up)
    tie_up: bool
    has_zero: bool


def _limits(fmt: FloatFormat) -> _Limits:
    step = math.ldexp(1.0, fmt.emin - fmt.mbits)
    top = math.ldexp(1.0, fmt.emax - fmt.mbits)
    flush = fmt.smallest_positive / 2 if fmt.has_zero else 0.0
    sub = fmt.min_normal - step / 2 if fmt.has_zero else 0.0
    return _Limits(flush, sub, fmt.max + top / 2, int(fmt.max / top) % 2 == 1, fmt.has_zero)


def _classify_points(v: np.ndarray, lim: _Limits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    flush = (v <= lim.flush) & lim.has_zero
    sub = (v > lim.flush) & (v < lim.sub)
    over = (v > lim.over) | ((v == lim.over) & lim.tie_up)
    return flush, sub, over


def predict(hist: LogHistogram, fmt: str | FloatFormat, scale: float = 1.0, noise: float = 0.0
            ) -> Prediction:  # fmt: skip
    """Predict casting ``scale * x`` to ``fmt`` from ``x``'s histogram; ``noise``: the relative power of
    the backward noise ``x`` carries before the cast (module docstring)."""
    fmt = get_format(fmt)
    scale = _scale(scale)
    if not (isinstance(noise, (int, float)) and 0 <= noise < math.inf):
        raise PolyampError(f"noise must be a finite relative power >= 0, got {noise!r}")
    _check_hist(hist)
    lim = _limits(fmt)
    idx = np.flatnonzero(hist.counts)
    c = hist.counts[idx].astype(np.float64)
    lo, hi = LO[idx].copy(), HI[idx].copy()
    if hist.amin_nonzero is not None:
        lo = np.maximum(lo, hist.amin_nonzero)
    hi = np.minimum(hi, hist.amax)  # amax is inside the highest non-empty bin
    low_point = hist.amin_nonzero if hist.amin_nonzero is not None else math.ldexp(1.0, B_MIN - 1)
    lo[idx == BELOW] = hi[idx == BELOW] = low_point
    lo[idx == ABOVE] = hi[idx == ABOVE] = hist.amax
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        lo, hi = lo * scale, hi * scale
        point = hi <= lo
        counts = np.zeros(3)  # flush, subnormal, overflow
        sums = np.zeros(4)  # relative squared error, noise energy, signal energy, its part below min_normal
        _points(lo[point], c[point], lim, fmt, counts, sums)
        _spread(lo[~point], hi[~point], c[~point], lim, fmt, counts, sums)
        if noise > 0 and lim.has_zero and sums[2] > 0:
            sigma = math.sqrt(noise * sums[2] / hist.finite_nonzero)
            moved = _noisy_flush(lo, hi, c, lim.flush, sigma) - counts[0]
            counts[0] += moved
            counts[1] = max(counts[1] - moved, 0.0)
    flush, sub, over = counts
    any_over = bool(_classify_points(np.array([hist.amax * scale]), lim)[2][0]) and hist.amax > 0
    over = max(over, 1.0) if any_over else 0.0
    if hist.amin_nonzero is not None:
        any_flush = bool(_classify_points(np.array([hist.amin_nonzero * scale]), lim)[0][0])
        flush = max(flush, 1.0) if any_flush else flush if noise > 0 else 0.0
    else:
        any_flush = bool(flush > 0)
    fnz = hist.finite_nonzero
    kept = fnz - over
    rel2, error, signal, low_error = (float(v) for v in sums)
    flush, sub, over = float(flush), float(sub), float(over)
    n = hist.total
    return Prediction(  # plain Python numbers throughout: the report's JSON is written from these
        format=fmt.name,
        scale=scale,
        total=int(n),
        overflow=over / n,
        flush=flush / n,
        subnormal=sub / n,
        normal=max(fnz - flush - sub - over, 0.0) / n,
        zeros=hist.zeros / n,
        nonfinite=hist.nonfinite / n,
        any_overflow=any_over,
        any_flush=any_flush,
        rel_rms_error=math.sqrt(rel2 / kept) if kept > 0 else 0.0,
        sqnr_db=10 * math.log10(signal / error) if error > 0 else math.inf,
        underflow_noise=low_error / signal if signal > 0 else 0.0,
    )


def _points(v, c, lim: _Limits, fmt: FloatFormat, counts, sums) -> None:
    """Point masses: classified by the thresholds, their error measured with ``quantize``."""
    if not v.size:
        return
    flush, sub, over = _classify_points(v, lim)
    counts += [c[flush].sum(), c[sub].sum(), c[over].sum()]
    keep = ~over
    v, c, flush = v[keep], c[keep], flush[keep]
    err = quantize(v, fmt) - v
    rel2 = np.where(flush, 1.0, (err / np.where(v > 0, v, 1.0)) ** 2)
    low = v < fmt.min_normal
    sums += [(c * rel2).sum(), (c * err**2).sum(), (c * v**2).sum(), (c * err**2)[low].sum()]


def _spread(lo, hi, c, lim: _Limits, fmt: FloatFormat, counts, sums) -> None:
    """Uniform bins [lo, hi): linear split over the regions, exact squared error per binade piece."""
    if not lo.size:
        return
    width = hi - lo
    density = c / width

    def overlap(a, b):
        return np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0.0, None)

    counts += [
        (density * overlap(0.0, lim.flush)).sum(),
        (density * overlap(lim.flush, lim.sub)).sum(),
        (density * overlap(lim.over, np.inf)).sum(),
    ]
    top = np.minimum(hi, lim.over)
    sums[2] += (density * _cube_diff(lo, np.maximum(top, lo))).sum() / 3
    f_hi = np.minimum(hi, lim.flush) if lim.has_zero else lo
    flushed = np.clip(f_hi - lo, 0.0, None)
    sums[0] += (density * flushed).sum()
    flushed_sq = (density * _cube_diff(lo, np.maximum(f_hi, lo))).sum() / 3
    sums[1] += flushed_sq
    sums[3] += flushed_sq
    a = np.maximum(lo, lim.flush)
    b = top
    ok = b > a
    a, b, dens = a[ok], b[ok], density[ok]
    ea = np.frexp(a)[1].astype(np.int64) - 1
    mid = np.minimum(np.ldexp(1.0, (ea + 1).astype(np.int32)), b)  # a bin spans at most two binades
    for p, r, e in ((a, mid, ea), (mid, b, ea + 1)):
        use = r > p
        sq = _grid_sq(p[use], r[use], e[use], fmt)
        sums[0] += (dens[use] * sq / (p[use] * r[use])).sum()
        sums[1] += (dens[use] * sq).sum()
        sums[3] += (dens[use] * sq)[e[use] < fmt.emin].sum()


def _noisy_flush(lo, hi, c, t: float, sigma: float) -> float:
    """Elements of the pieces [lo, hi) (points where hi <= lo) with ``|v + N(0, sigma^2)| <= t``."""
    point = hi <= lo
    za, zb = (t - lo) / sigma, (t - hi) / sigma
    ya, yb = (-t - lo) / sigma, (-t - hi) / sigma
    width = np.where(point, 1.0, hi - lo)
    spread = sigma / width * (_G(za) - _G(zb) - _G(ya) + _G(yb))
    at_point = _Phi(za) - _Phi(ya)
    return float((c * np.clip(np.where(point, at_point, spread), 0.0, 1.0)).sum())


_erfc = np.frompyfunc(math.erfc, 1, 1)


def _Phi(z):
    """The standard normal CDF."""
    return _erfc(-np.asarray(z, np.float64) / math.sqrt(2)).astype(np.float64) / 2


def _G(z):
    """The integral of the normal CDF: z Phi(z) + phi(z)."""
    z = np.asarray(z, np.float64)
    return z * _Phi(z) + np.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def _cube_diff(a, b):
    """b^3 - a^3 without cancellation."""
    return (b - a) * (a * a + a * b + b * b)


def _grid_sq(p, r, e, fmt: FloatFormat):
    """Integral over [p, r) of the squared distance to the format's grid, all within binade ``e``."""
    if not fmt.has_zero:  # below min_normal everything clamps up to it
        m = fmt.min_normal
        low = e < fmt.emin
        clamp = ((m - p) ** 3 - (m - r) ** 3) / 3
    q = np.ldexp(1.0, (np.maximum(e, fmt.emin) - fmt.mbits).astype(np.int32))
    n_p, n_r = np.floor(p / q), np.floor(r / q)
    out = (n_r - n_p) * q**3 / 12 + _cell_sq(r - n_r * q, q) - _cell_sq(p - n_p * q, q)
    return np.where(low, clamp, out) if not fmt.has_zero else out


def _cell_sq(t, q):
    """Integral over [0, t) of the squared distance to {0, q}, for 0 <= t < q."""
    return np.where(t <= q / 2, t**3 / 3, q**3 / 12 - (q - t) ** 3 / 3)


def predict_scales(
    hist: LogHistogram, fmt: str | FloatFormat, scales: Iterable[float]
) -> tuple[Prediction, ...]:
    """``predict`` at each loss scale (gradients: every value is multiplied by the scale)."""
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Iterable):
        raise PolyampError(f"scales must be a sequence of positive numbers, got {scales!r}")
    fmt = get_format(fmt)
    return tuple(predict(hist, fmt, s) for s in scales)


def lost_updates(ratio_hist: LogHistogram, fmt: str | FloatFormat) -> LostUpdates:
    """Fraction of updates lost when added to weights stored in ``fmt``, from an update-ratio histogram.

    Rule: with M mantissa bits, ``|u| < ulp(w) / 2 = 2^(b(w) - M - 1)`` leaves w unchanged, i.e. the
    ratio ``r = |u| / 2^b(w)`` below ``2^-(M+1)``: the bins under that edge, exactly. Not modelled: a
    weight exactly at a power of two whose update points toward zero (the spacing below it is half, so
    it is lost only for r <= 2^-(M+2): counted lost, an overcount bounded by the share of such weights);
    a tie r == 2^-(M+1) (lost when w's significand is even: counted kept); weights below the format's
    min_normal (coarser subnormal spacing: undercounted).
    """
    fmt = get_format(fmt)
    _check_hist(ratio_hist)
    edge = SUB * (-(fmt.mbits + 1) - B_MIN) + 1  # first bin of binade -(M+1)
    n = ratio_hist.total
    return LostUpdates(
        format=fmt.name,
        total=n,
        lost=int(ratio_hist.counts[:edge].sum()) / n,
        zero_update=ratio_hist.zeros / n,
        zero_weight=ratio_hist.apart / n,
        nonfinite=ratio_hist.nonfinite / n,
    )


def _scale(scale) -> float:
    ok = isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, (bool, np.bool_))
    if not ok or not (0 < float(scale) < math.inf):
        raise PolyampError(f"scale must be a finite number > 0 (a loss scale), got {scale!r}")
    return float(scale)


def _check_hist(hist) -> None:
    if not isinstance(hist, LogHistogram):
        raise PolyampError(f"expected a LogHistogram, got {type(hist).__name__}")
    if hist.total == 0:
        raise PolyampError("empty histogram (no elements): nothing to predict; observe at least one element")
