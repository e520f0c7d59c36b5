"""Log2-magnitude histograms: the one statistic every doctor front end collects.

Binning spec (front ends implement exactly this with their own ops; ``bin_index`` is the numpy reference)::

    SUB = 16, B_MIN = -149, B_MAX = 127, N_BINS = SUB * (B_MAX - B_MIN + 1) + 2 = 4434
    for each element x:
        x == 0 (either sign)   -> zeros += 1
        x is inf or nan        -> nonfinite += 1
        otherwise:
            m, e = frexp(|x|)               # |x| = m * 2^e, 0.5 <= m < 1 (np/jnp/torch.frexp)
            b = e - 1                       # binade: 2^b <= |x| < 2^(b+1)
            k = floor((2*m - 1) * SUB)      # sub-bin 0..SUB-1, linear in the mantissa (exact in float32)
            i = clip(SUB * (b - B_MIN) + k + 1, 0, N_BINS - 1)
            counts[i] += 1
    amax = max finite |x| (0.0 if none); amin_nonzero = min finite non-zero |x| (None if none or unknown)

Bin 0 ("below") holds 0 < |x| < 2^B_MIN (only float64 values and ratios get there); bin N_BINS-1 ("above")
holds |x| >= 2^(B_MAX+1); bin i in 1..N_BINS-2 holds b = B_MIN + (i-1) // SUB, k = (i-1) % SUB, that is
``2^b * (1 + k/SUB) <= |x| < 2^b * (1 + (k+1)/SUB)``. float32's binades are exactly B_MIN..B_MAX.
Without frexp (TensorFlow), for float32: scale |x| < 2^-126 by 2^64 (exact), bitcast to int32 ``u``,
``b = (u >> 23) - 127`` (minus 64 if scaled), ``k = (u >> 19) & 15``.

Update ratio (kind "update_ratio"): for an update u to a weight w, elementwise, in this order: u or w
non-finite -> nonfinite; w == 0 -> apart (counted apart: no ratio); u == 0 -> zeros; otherwise the same
index with ``b = b(u) - b(w)`` and ``k = k(u)``, i.e. the binning of ``r = |u| / 2^b(w)``: the update
relative to the weight's binade (not to |w| itself), so that "|u| is below half an ulp of w in a format
with M mantissa bits" is exactly ``r < 2^-(M+1)``, a bin edge (see ``predict.lost_updates``).
amax/amin_nonzero are those of r (float64).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ..errors import PolyampError

SUB = 16
B_MIN = -149
B_MAX = 127
N_BINS = SUB * (B_MAX - B_MIN + 1) + 2
BELOW, ABOVE = 0, N_BINS - 1
_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))


def _edges() -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(1, N_BINS - 1)
    b, k = B_MIN + (i - 1) // SUB, (i - 1) % SUB
    lo = np.ldexp(1.0 + k / SUB, b)
    hi = np.ldexp(1.0 + (k + 1) / SUB, b)
    lo = np.concatenate([[0.0], lo, [math.ldexp(1.0, B_MAX + 1)]])
    hi = np.concatenate([[math.ldexp(1.0, B_MIN)], hi, [math.inf]])
    lo.setflags(write=False)
    hi.setflags(write=False)
    return lo, hi


LO, HI = _edges()  # bin i holds LO[i] <= |x| < HI[i]


def bin_index(a: np.ndarray) -> np.ndarray:
    """The spec's bin of each finite non-zero magnitude ``a`` (float32 or float64), as int64."""
    m, e = np.frexp(a)
    return _index(e.astype(np.int64) - 1, m)


def _index(b: np.ndarray, m: np.ndarray) -> np.ndarray:
    k = np.floor((2 * m - 1) * SUB).astype(np.int64)
    return np.clip(SUB * (b - B_MIN) + k + 1, 0, N_BINS - 1)


@dataclass(frozen=True, eq=False)
class LogHistogram:
    """Counts of |x| by binade and sub-bin (module docstring), plus zeros, non-finite and extremes.

    ``total = counts.sum() + zeros + nonfinite + apart``; ``apart`` is used only by update-ratio
    histograms (elements whose weight is zero).
    """

    counts: np.ndarray
    zeros: int = 0
    nonfinite: int = 0
    amax: float = 0.0
    amin_nonzero: float | None = None
    apart: int = 0
    total: int = field(default=-1)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts)
        if counts.shape != (N_BINS,) or counts.dtype.kind not in "iu" or (counts < 0).any():
            raise PolyampError(
                f"counts must be {N_BINS} non-negative integers (the binning spec in "
                f"polyamp.doctor.histogram), got shape {counts.shape} dtype {counts.dtype}"
            )
        counts = counts.astype(np.int64)
        counts.setflags(write=False)
        object.__setattr__(self, "counts", counts)
        for name in ("zeros", "nonfinite", "apart"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
                raise PolyampError(f"{name} must be a non-negative integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        expected = int(counts.sum()) + self.zeros + self.nonfinite + self.apart
        if self.total == -1:
            object.__setattr__(self, "total", expected)
        elif self.total != expected:
            raise PolyampError(f"total {self.total!r} != counts + zeros + nonfinite + apart = {expected}")
        self._check_extremes()

    def _check_extremes(self) -> None:
        amax, amin = self.amax, self.amin_nonzero
        if not _is_real(amax) or not math.isfinite(amax) or amax < 0:
            raise PolyampError(f"amax must be a finite number >= 0, got {amax!r}")
        object.__setattr__(self, "amax", float(amax))
        if amin is not None:
            if not _is_real(amin) or not 0 < amin < math.inf:
                raise PolyampError(f"amin_nonzero must be a finite number > 0 or None, got {amin!r}")
            object.__setattr__(self, "amin_nonzero", float(amin))
        used = np.flatnonzero(self.counts)
        if not used.size:
            if amax != 0 or amin is not None:
                raise PolyampError(
                    f"no non-zero finite element is counted but amax={amax!r}, "
                    f"amin_nonzero={amin!r} (expected 0.0 and None)"
                )
            return
        for name, value, i in (("amax", amax, used[-1]), ("amin_nonzero", amin, used[0])):
            if value is not None and not LO[i] <= value < HI[i]:
                raise PolyampError(
                    f"{name}={value!r} is outside the {'highest' if name == 'amax' else 'lowest'} "
                    f"non-empty bin {i} [{LO[i]!r}, {HI[i]!r}); the counts and {name} disagree"
                )

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def of(cls, x) -> LogHistogram:
        """The histogram of a numpy array (float16, bfloat16, float32 or float64)."""
        a = np.abs(_as_array(x, "x")).ravel()
        finite = np.isfinite(a)
        v = a[finite & (a != 0)]
        return cls(
            counts=np.bincount(bin_index(v), minlength=N_BINS),
            zeros=int(finite.sum()) - v.size,
            nonfinite=a.size - int(finite.sum()),
            amax=float(v.max()) if v.size else 0.0,
            amin_nonzero=float(v.min()) if v.size else None,
        )

    @classmethod
    def from_counts(
        cls,
        counts,
        zeros: int,
        nonfinite: int,
        amax: float,
        amin_nonzero: float | None = None,
        *,
        apart: int = 0,
        total: int | None = None,
    ) -> LogHistogram:
        """For front ends that bin on their own device: ``counts`` is the flat array of the spec."""
        arr = np.asarray(counts)
        if arr.dtype.kind == "f" and arr.size and np.array_equal(arr, np.round(arr)):
            arr = arr.astype(np.int64)  # some frameworks count in floats
        return cls(
            counts=arr,
            zeros=zeros,
            nonfinite=nonfinite,
            amax=amax,
            amin_nonzero=amin_nonzero,
            apart=apart,
            total=-1 if total is None else total,
        )

    def merge(self, *others: LogHistogram) -> LogHistogram:
        """One histogram of all the elements of ``self`` and ``others``."""
        hists = (self, *others)
        for h in others:
            if not isinstance(h, LogHistogram):
                raise PolyampError(f"merge takes LogHistograms, got {type(h).__name__}")
        mins = [h.amin_nonzero for h in hists if h.amin_nonzero is not None]
        return LogHistogram(
            counts=sum((h.counts for h in hists), np.zeros(N_BINS, np.int64)),
            zeros=sum(h.zeros for h in hists),
            nonfinite=sum(h.nonfinite for h in hists),
            amax=max(h.amax for h in hists),
            amin_nonzero=min(mins) if mins else None,
            apart=sum(h.apart for h in hists),
        )

    # -- views ---------------------------------------------------------------------------------
    @property
    def finite_nonzero(self) -> int:
        return int(self.counts.sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LogHistogram):
            return NotImplemented
        return np.array_equal(self.counts, other.counts) and all(
            getattr(self, f) == getattr(other, f)
            for f in ("zeros", "nonfinite", "amax", "amin_nonzero", "apart", "total")
        )

    __hash__ = None  # type: ignore[assignment]

    def to_json(self) -> dict:
        """A JSON-able dict; the counts as [index, count] pairs of the non-empty bins."""
        used = np.flatnonzero(self.counts)
        return {
            "spec": {"sub": SUB, "b_min": B_MIN, "b_max": B_MAX},
            "bins": [[int(i), int(self.counts[i])] for i in used],
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
            "apart": self.apart,
            "total": self.total,
            "amax": self.amax,
            "amin_nonzero": self.amin_nonzero,
        }

    @classmethod
    def from_json(cls, data: dict | str) -> LogHistogram:
        """Inverse of ``to_json`` (a dict or its JSON text)."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict):
            raise PolyampError(f"expected a dict from LogHistogram.to_json, got {type(data).__name__}")
        spec = {"sub": SUB, "b_min": B_MIN, "b_max": B_MAX}
        if data.get("spec") != spec:
            raise PolyampError(f"histogram spec {data.get('spec')!r} differs from this version's {spec}")
        missing = {"bins", "zeros", "nonfinite", "amax", "amin_nonzero", "total"} - set(data)
        if missing:
            raise PolyampError(f"histogram JSON lacks {sorted(missing)}")
        counts = np.zeros(N_BINS, np.int64)
        try:
            for i, c in data["bins"]:
                counts[int(i)] += int(c)
        except (TypeError, ValueError, IndexError) as err:
            raise PolyampError(
                f"bad histogram bins ({err}); expected [[index < {N_BINS}, count], ...]"
            ) from None
        return cls(
            counts=counts,
            zeros=data["zeros"],
            nonfinite=data["nonfinite"],
            amax=data["amax"],
            amin_nonzero=data["amin_nonzero"],
            apart=data.get("apart", 0),
            total=data["total"],
        )


def update_ratio_histogram(update, weight) -> LogHistogram:
    """The histogram of ``|update| / 2^b(weight)`` per element (module docstring, "Update ratio")."""
    u = np.abs(_as_array(update, "update")).astype(np.float64)
    w = np.abs(_as_array(weight, "weight")).astype(np.float64)
    if u.shape != w.shape:
        raise PolyampError(f"update shape {u.shape} differs from weight shape {w.shape}; expected the same")
    u, w = u.ravel(), w.ravel()
    bad = ~(np.isfinite(u) & np.isfinite(w))
    apart = ~bad & (w == 0)
    zeros = ~bad & ~apart & (u == 0)
    sel = ~(bad | apart | zeros)
    mu, eu = np.frexp(u[sel])
    _, ew = np.frexp(w[sel])
    shift = eu.astype(np.int64) - ew.astype(np.int64)
    idx = _index(shift, mu)
    with np.errstate(over="ignore", under="ignore"):
        r = np.minimum(np.ldexp(mu, (shift + 1).astype(np.int32)), np.finfo(np.float64).max)
    tiny = (r == 0).any()  # a float64 ratio below 2^-1074 keeps its bin (0); amin is then unknown
    return LogHistogram(
        counts=np.bincount(idx, minlength=N_BINS),
        zeros=int(zeros.sum()),
        nonfinite=int(bad.sum()),
        amax=float(r.max()) if r.size else 0.0,
        amin_nonzero=float(r.min()) if r.size and not tiny else None,
        apart=int(apart.sum()),
    )


def _as_array(x, name: str) -> np.ndarray:
    if type(x).__module__.split(".")[0] in ("torch", "tensorflow", "jax", "jaxlib", "mxnet"):
        raise PolyampError(
            f"{name}: the numpy core takes numpy arrays, got {type(x).__module__}."
            f"{type(x).__name__}; a front end bins on its device and calls from_counts"
        )
    arr = np.asarray(x)
    if arr.dtype not in _DTYPES:
        raise PolyampError(
            f"{name}: expected a floating-point array, got dtype {arr.dtype}; accepted: "
            + ", ".join(str(d) for d in _DTYPES)
        )
    if arr.dtype.itemsize == 2:
        arr = arr.astype(np.float32)  # exact; frexp on float32
    return arr


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
