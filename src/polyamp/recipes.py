"""Low-precision training recipes as framework-neutral numpy arithmetic (amax -> scale).

Four recipes, each a frozen :class:`Recipe` from :func:`get_recipe`::

    fp8-tensorwise  current scaling, one float32 scale per tensor: e4m3fn forward, e5m2 gradients
                    (TE ``Float8CurrentScaling`` with ``Format.HYBRID``; torchao ``tensorwise``)
    fp8-delayed     the same formats, the scale from an amax history (TE ``DelayedScaling``)
    mxfp8           MX blocks of 32 with an E8M0 scale, ``rceil`` rule, e4m3 in both passes
                    (TE ``MXFP8BlockScaling``)
    nvfp4           e2m1 blocks of 16 with an e4m3 scale and a float32 tensor scale, 16x16 blocks
                    for weights, stochastic rounding on gradients, optional random Hadamard transform
                    on the weight-gradient operands (TE ``NVFP4BlockScaling``)

The scale rules, with ``Fmax`` the element format's largest finite value:

- :func:`current_scale`: ``scale = (Fmax / amax) / 2^margin`` rounded once to float32.
- :class:`DelayedScaling`: the same with ``amax`` the max (or the latest) of an amax history.
- :func:`quantize_tensorwise`: ``quantize(fp32(x * scale), fmt, saturate=True) / scale``.

Convolutions run as the implicit GEMMs they are (``K`` = input channels per group times kernel
positions), each operand blocked along a dimension its GEMM sums over, the layout of microxcaling's
``mx/convolution.py``::

    forward      y  = conv(Qf(x), Qf(W))              x along its channels, W along its input channels
    input grad   dx = conv_input(Qb(g), Qf'(W))       g along its channels, W along its output channels
    weight grad  dW = conv_weight(Qf'(x), Qb'(g))     x and g along the batch axis

Per-tensor formats quantize each operand once, as for a linear layer. NVFP4's 16x16 weight blocks tile
(output, input) channels at each kernel position and serve both GEMMs. Its Hadamard transform
multiplies ``x`` and ``g`` in tiles of 16 along the batch axis (zero padded): ``dW = sum_n
conv_weight(x_n, g_n)`` and ``H^T H = I``, so only the quantization error changes. A block-format
operand is quantized with its blocked axis moved last; stochastic rounding indexes that tensor's
elements. The keep list's ``first`` / ``last`` count convolution layers as matmul layers.

Sources (read in the code search corpus): TransformerEngine
``transformer_engine/common/recipe/__init__.py`` (recipe fields and defaults),
``transformer_engine/common/recipe/recipe_common.cuh::compute_scale_from_amax`` (current scaling),
``transformer_engine/common/recipe/delayed_scaling.cu`` and ``transformer_engine/pytorch/
quantization.py::_default_sf_compute`` / ``_update_amax_history`` (delayed scaling); torchao
``torchao/float8/float8_utils.py::amax_to_scale`` (``finfo.max / clamp(amax.double(), 1e-12)``
then float32) and ``torchao/float8/config.py``.

:class:`Recipe` and the other settings are defined in ``recipe_specs.py``, as this module's public API.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import PolyampError, invalid
from .numerics import get_format, quantize
from .numerics import xp as numpy_ops
from .numerics.formats import FloatFormat
from .recipe_specs import AMAX_COMPUTE_ALGOS as AMAX_COMPUTE_ALGOS
from .recipe_specs import BUILT_ON as BUILT_ON
from .recipe_specs import KEEP_TOKENS as KEEP_TOKENS
from .recipe_specs import RECIPES as RECIPES
from .recipe_specs import Recipe as Recipe
from .recipe_specs import get_recipe as get_recipe
from .recipe_specs import parse_recipe as parse_recipe
from .recipe_specs import recipe_spec as recipe_spec
from .recipe_specs import refusal as refusal
from .step import is_count, is_number

_FLT_MAX = float(np.finfo(np.float32).max)

# ----------------------------------------------------------------------------------------------
# scale arithmetic


def _fmax(fmt) -> tuple[FloatFormat, float]:
    f = get_format(fmt)
    return f, float(f.max)


def _amax32(amax, what: str = "amax") -> np.ndarray:
    """``amax`` as float32 (how TE's history and torchao's bf16/fp32 amax hold it); >= 0 or NaN."""
    try:
        a = np.asarray(amax, dtype=np.float64)
    except (TypeError, ValueError):
        raise PolyampError(f"{what} must be a number >= 0 (or an array of them); received {amax!r}") from None
    if isinstance(amax, (bool, np.bool_)) or np.any(a < 0):
        raise PolyampError(f"{what} must be a number >= 0 (or an array of them); received {amax!r}")
    with np.errstate(over="ignore"):
        return a.astype(np.float32)


def _scaled_max(fmax: float, margin) -> float:
    if not is_count(margin, 0):
        raise PolyampError(f"margin must be an integer >= 0; received {margin!r}")
    return float(np.float32(fmax * 2.0**-margin))  # TE: fp8_max * 2^-margin, a float32


def amax_scale(ops, amax32, scaled_max: float, eps: float, fallback):
    """TE's rule on float32 amaxes, over an ops module (``numerics/xp.py`` or a front end's ``xp``):
    ``scaled_max / max(amax, eps)`` in float64, rounded once to float32; ``fallback`` where that amax is
    0 or not finite; float32's max where the quotient overflows. float32 out, on the amaxes' device."""
    a = ops.float64(amax32)
    a = ops.where(a < ops.const(eps, a), eps, a)  # NaN stays NaN (a comparison with NaN is False)
    q = ops.float32_round(ops.const(scaled_max, a) / a)  # float64 quotient rounded to float32: see below
    q = ops.where(ops.isinf(q), _FLT_MAX, q)
    return ops.float32(ops.where(ops.isfinite(a) & (a > 0), q, fallback))


def current_scale_of(ops, amax32, fmt, margin: int = 0, eps: float = 0.0):
    """:func:`current_scale` of a front end's float32 amax array over its ops module ``ops``, on the
    array's device (no host read); ``fmt``, ``margin`` and ``eps`` as a :class:`Recipe` holds them."""
    return amax_scale(ops, amax32, _scaled_max(_fmax(fmt)[1], margin), eps, 1.0)


def _scale(amax32: np.ndarray, scaled_max: float, eps: float, fallback) -> np.ndarray:
    """``amax_scale`` over numpy."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return amax_scale(numpy_ops, amax32, scaled_max, eps, fallback)


def current_scale(amax, fmt, margin: int = 0, eps: float = 0.0):
    """Current (per-tensor) scaling: ``scale = (Fmax / max(amax, eps)) / 2^margin`` as float32.

    ``amax`` (a number or array, >= 0) is first held as float32. The quotient is rounded once to
    float32: TE divides in float32 (``recipe_common.cuh::compute_scale_from_amax``, ``__fdiv_rn``);
    torchao divides in float64 and casts (``float8_utils.py::amax_to_scale``); for a float32 amax the
    two agree bit for bit (double rounding 53 -> 24 bits of a quotient of 24-bit numbers is innocuous,
    as 53 >= 2*24 + 2), and both are this function's result.

    Edge cases follow TE's current scaling: an amax that is 0 (after the ``eps`` floor) or not finite
    gives scale 1.0; a quotient beyond float32 gives float32's max. torchao instead floors the amax
    at ``eps=1e-12`` (pass ``eps=1e-12`` to get its scale for amax 0: ``float32(448 / 1e-12)``), and
    gives 0 for an infinite and NaN for a NaN amax. ``margin`` is TE's delayed-scaling margin (current
    scaling in TE and torchao has none: margin 0).

    >>> float(current_scale(3.5, "e4m3fn")), float(current_scale(3.5, "e4m3fn", margin=1))
    (128.0, 64.0)
    """
    _, fmax = _fmax(fmt)
    if not (is_number(eps) and 0 <= eps < math.inf):
        raise PolyampError(f"eps must be a finite number >= 0; received {eps!r}")
    out = _scale(_amax32(amax), _scaled_max(fmax, margin), float(eps), 1.0)
    return out[()] if out.ndim == 0 else out


def quantize_tensorwise(x, fmt, scale, rounding: str = "nearest", seed: int | None = None) -> np.ndarray:
    """Quantize-dequantize ``x`` with one per-tensor scale: ``quantize(x * scale, fmt) / scale``.

    As TE's cast kernels and torchao (``hp_tensor.to(float32) * scale``) compute it: ``x`` and
    ``scale`` are taken as float32, their product is rounded to float32, that is rounded to ``fmt``
    (saturating at +-Fmax, so an amax above the scale's range clips), and the result is divided by
    ``scale`` in float32. Rounding the product first is deliberate (it is what the frameworks do, so
    a framework kernel can match this bit for bit); it differs from rounding the exact product only
    when that product lies within float32's rounding of a ``fmt`` tie. Returns float32.
    """
    if not (is_number(scale) and 0 < scale < math.inf) and not (
        isinstance(scale, np.ndarray) and scale.ndim == 0 and np.isfinite(scale) and scale > 0
    ):
        raise PolyampError(f"scale must be a finite number > 0; received {scale!r}")
    s = np.float32(scale)
    if not (np.isfinite(s) and s > 0):
        raise PolyampError(f"scale {scale!r} is not a finite positive float32")
    try:
        x32 = np.asarray(x).astype(np.float32)
    except (TypeError, ValueError):
        raise PolyampError(f"x must be a float array; received {type(x).__name__}") from None
    if x32.dtype.kind != "f" or np.asarray(x).dtype.kind not in "fiu":
        raise PolyampError(f"x must be a float array; received dtype {np.asarray(x).dtype}")
    with np.errstate(over="ignore"):
        q = quantize(x32 * s, fmt, rounding=rounding, saturate=True, seed=seed)
    return np.asarray(q, dtype=np.float32) / s


# ----------------------------------------------------------------------------------------------
# delayed scaling


class DelayedScaling:
    """TE's delayed scaling for one tensor: an amax history and the scale derived from it.

    ``history[0]`` is this step's slot. :meth:`update` (TE ``delayed_scaling.cu`` /
    ``quantization.py``), once per step after the tensor was quantized with :attr:`scale`:

    1. write this step's amax (as float32) into ``history[0]``;
    2. ``amax`` = max over the whole history (``max``; NaN entries are skipped as CUDA's ``fmaxf``
       does, in TE's fused kernel) or ``history[0]`` (``most_recent``);
    3. ``scale = (Fmax * 2^-margin) / amax`` rounded once to float32; the previous scale is kept when
       that amax is 0 or not finite, float32's max is used when the quotient overflows;
    4. roll the history by one (``[h0, h1, .., hn-1] -> [0, h2, .., hn-1, h0]``): the oldest entry
       ``h1`` drops out and the slot for the next step is 0.

    The scale starts at 1.0 and the history at zeros, as in TE. ``state_dict()`` holds plain Python
    numbers (JSON-able; a non-finite amax is written as ``NaN`` / ``Infinity`` by ``json``) and
    :meth:`load_state_dict` restores the state bit for bit.
    """

    def __init__(self, fmt="e4m3fn", history_len: int = 1024, amax_compute_algo: str = "max",
                 margin: int = 0) -> None:  # fmt: skip
        self.format, fmax = _fmax(fmt)
        if not is_count(history_len, 1):
            raise PolyampError(f"history_len must be an integer >= 1; received {history_len!r}")
        if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise invalid("amax_compute_algo", amax_compute_algo, AMAX_COMPUTE_ALGOS)
        self._scaled_max = _scaled_max(fmax, margin)
        self.history_len, self.margin = int(history_len), int(margin)
        self.amax_compute_algo = amax_compute_algo
        self.history = np.zeros(self.history_len, dtype=np.float32)
        self._scale = np.float32(1.0)
        self.steps = 0

    @classmethod
    def from_recipe(cls, recipe: Recipe | str, backward: bool = False) -> DelayedScaling:
        """The state for one tensor of a ``fp8-delayed`` recipe (its gradient format if ``backward``)."""
        r = get_recipe(recipe)
        if r.kind != "delayed":
            raise PolyampError(f"DelayedScaling needs a delayed-scaling recipe; {r.name!r} is {r.kind}")
        fmt = r.backward_format if backward else r.forward_format
        return cls(fmt, r.history_len, r.amax_compute_algo, r.margin)

    @property
    def scale(self) -> np.float32:
        """The scale to quantize with at this step."""
        return self._scale

    def update(self, amax) -> np.float32:
        """Record this step's ``amax`` (a number >= 0, NaN or inf) and return the next step's scale."""
        a = _amax32(amax)
        if a.ndim != 0:
            raise PolyampError(f"amax must be one number per tensor; received shape {a.shape}")
        h = self.history
        h[0] = a
        amax_used = np.fmax.reduce(h) if self.amax_compute_algo == "max" else h[0]
        self._scale = _scale(np.asarray(amax_used, np.float32), self._scaled_max, 0.0, self._scale)[()]
        self.history = np.roll(h, -1)
        self.history[0] = 0.0
        self.steps += 1
        return self._scale

    def state_dict(self) -> dict[str, Any]:
        """Config and state as plain Python numbers and lists."""
        return {
            "format": self.format.name,
            "history_len": self.history_len,
            "amax_compute_algo": self.amax_compute_algo,
            "margin": self.margin,
            "scale": float(self._scale),
            "history": [float(v) for v in self.history],
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (of a DelayedScaling with the same config), bit for bit."""
        if not isinstance(state, Mapping):
            raise PolyampError(f"expected a dict from DelayedScaling.state_dict(); received {state!r}")
        mine = self.state_dict()
        unknown = [k for k in state if k not in mine]
        if unknown:
            raise invalid("DelayedScaling state field", unknown[0], list(mine))
        missing = [k for k in mine if k not in state]
        if missing:
            raise PolyampError(f"DelayedScaling state lacks {missing}; received keys {sorted(state)}")
        for key in ("format", "history_len", "amax_compute_algo", "margin"):
            theirs = state[key]
            if key == "format" and isinstance(theirs, str):
                try:
                    theirs = get_format(theirs).name
                except PolyampError:
                    pass
            if theirs != mine[key]:
                raise PolyampError(f"DelayedScaling state was saved with {key}={state[key]!r}, this one has "
                                   f"{key}={mine[key]!r}; build it with the saved config")  # fmt: skip
        scale, history, steps = state["scale"], state["history"], state["steps"]
        if not (_is_f32(scale) and 0 < scale < math.inf):
            raise PolyampError(f"DelayedScaling state scale must be a finite float32 > 0; received {scale!r}")
        if not isinstance(history, (list, tuple)) or len(history) != self.history_len:
            raise PolyampError(f"DelayedScaling state history must be a list of {self.history_len} amaxes; "
                               f"received {_brief(history)}")  # fmt: skip
        bad = [v for v in history if not (_is_f32(v) or isinstance(v, float) and math.isnan(v)) or v < 0]
        if bad:
            raise PolyampError(f"DelayedScaling state history holds {bad[0]!r}; each amax must be a float32 "
                               "value >= 0, inf or NaN")  # fmt: skip
        if not is_count(steps, 0):
            raise PolyampError(f"DelayedScaling state steps must be an integer >= 0; received {steps!r}")
        self._scale = np.float32(scale)
        self.history = np.asarray(history, dtype=np.float64).astype(np.float32)
        self.steps = int(steps)


def _is_f32(v) -> bool:
    """A real number (inf allowed) that float32 holds exactly."""
    if not is_number(v):
        return False
    with np.errstate(over="ignore"):
        return float(np.float32(v)) == float(v)


def _brief(v) -> str:
    n = len(v) if isinstance(v, (list, tuple)) else None
    return f"{type(v).__name__} of length {n}" if n is not None else repr(v)[:80]
