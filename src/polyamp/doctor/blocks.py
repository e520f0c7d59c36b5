"""Measured statistics of block formats and per-tensor fp8 scaling: what a cast does to one tensor.

A histogram of |x| cannot say what a block format does (each block's scale follows its own amax), so
for these the doctor quantizes each tapped tensor and counts. Spellings ``formats`` accepts here
(``parse``; the scalar formats stay predicted, ``predict.py``):

- a block format of ``polyamp.numerics.BLOCK_FORMATS`` (``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``,
  ``mxfp6_e2m3``, ``mxfp4``, ``nvfp4``), for MX optionally ``:<scale rule>`` (``mxfp8_e4m3:rceil``;
  default ``floor``, OCP MX v1.0's): every output, output gradient, weight and weight gradient in
  blocks of the format's size along its last axis, rounded to nearest;
- a recipe, ``recipe:<name>`` in ``recipes.parse_recipe``'s spelling (``recipe:fp8-tensorwise``,
  ``recipe:mxfp8``, ``recipe:nvfp4``, ``recipe:mxfp8:scale_rule=floor``); a recipe name that is not a
  block format also works bare (``fp8-tensorwise``, ``mxfp8``). Per operand kind: outputs (the next
  layer's inputs) and weights in the forward format, output gradients in the backward format with
  its rounding (stochastic from seed ``SEED``); NVFP4 weights of 2 or more axes in 16x16 blocks
  (``weight_2d``); weight gradients are not measured (no recipe quantizes them: they are a GEMM's
  result). Tensorwise scaling: ``scale = current_scale(amax)`` per tensor, ``quantize_tensorwise``.
  ``fp8-delayed`` is refused: its scale comes from earlier steps' amaxes. Every layer is measured, also
  those the recipe's ``keep`` leaves unquantized, and as if all three GEMMs were quantized.

Per tensor, over its elements x (as float32) and their casts q, counting the non-zero finite ones:
``underflow`` (q is +-0), ``clipped`` (|x| beyond the largest value of its block or tensor: |x| >
Fmax * scale for blocks, fp32(|x| * scale) > Fmax tensorwise; rceil never clips, floor can),
``spoiled`` (in a block holding inf or NaN: the block is NaN); the relative MSE ``sum (q - x)^2 /
sum x^2`` and SQNR ``-10 log10`` of it, over the finite elements outside spoiled blocks. Non-finite
elements are counted (``nonfinite``) and left out; tensorwise, a tensor with one gets scale 1 (TE's
rule for a non-finite amax). Counts and sums add up over calls and steps (``Measured.merge``);
``Measured.to_json`` gives the three shares as fractions of the non-zero finite elements.

``measure`` is the numpy reference; the torch and JAX front ends measure on the device with their
kernels (``measure_on`` over their ops, ``polyamp.<framework>.doctor.measure_tensor``) and ``plan``
(per-block clip thresholds from the blocks' amaxes, computed here on the host), tested equal to it.
TensorFlow and MXNet measure a numpy copy with ``measure`` (``Meter``). Blocks run along the GEMM's
reduction axis, as the recipes block the forward operands: the last axis of outputs (the next layer's
inputs) and of a torch / MXNet weight ``(out, in)``; a JAX / Keras 2-d kernel ``(in, out)`` and its
gradient are measured transposed (``gemm_layout``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..errors import PolyampError
from ..numerics import BLOCK_FORMATS, get_format, quantize_blocks
from ..numerics import blocks as _core
from ..numerics.blocks import SCALE_RULES
from ..numerics.rounding import _MODE
from ..recipes import RECIPES, current_scale, parse_recipe, quantize_tensorwise, recipe_spec

PREFIX = "recipe:"
SEED = 0  # stochastic rounding's seed (a recipe's gradients)
MEASURED_KINDS = ("output", "grad_output", "weight", "grad_weight")
_FLT_MAX = np.float32(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Cast:
    """How one tensor is cast: ``scaling`` "block" (``format`` a block format) or "tensorwise" (a scalar
    fp8 format, ``current_scale``); ``block`` the block shape ((16, 16): the last two axes, 1x16 for a
    tensor of fewer axes)."""

    format: str
    scaling: str
    block: tuple[int, ...] = ()
    scale_rule: str | None = None
    rounding: str = "nearest"
    margin: int = 0
    eps: float = 0.0

    @property
    def seed(self) -> int | None:
        return SEED if self.rounding == "stochastic" else None

    def block_for(self, ndim: int) -> tuple[int, ...]:
        """The block shape used on a tensor of ``ndim`` axes."""
        return self.block[-1:] if len(self.block) == 2 and ndim < 2 else self.block


@dataclass(frozen=True)
class Target:
    """One measured entry of ``formats``: its label and the cast of each tensor kind it measures."""

    label: str
    casts: dict[str, Cast]


def accepted() -> str:
    """The measured spellings, for error messages."""
    mx = [n for n, f in BLOCK_FORMATS.items() if f.rules]
    return (f"block formats {', '.join(BLOCK_FORMATS)} (MX ones optionally with :{'|:'.join(SCALE_RULES)}, "
            f"e.g. {mx[0]}:rceil); recipes {', '.join(PREFIX + r for r in RECIPES if r != 'fp8-delayed')} "
            "(overrides as in parse_recipe, e.g. recipe:mxfp8:scale_rule=floor)")  # fmt: skip


def parse(name: str) -> Target | None:
    """The measured target ``name`` spells, or None for a scalar format (predicted). Raises
    PolyampError for a name that is neither."""
    if not isinstance(name, str):
        raise PolyampError(f"expected a format name, got {type(name).__name__} {name!r}")
    text = name.strip()
    if text.lower().startswith(PREFIX):
        return _recipe_target(text[len(PREFIX) :])
    head, _, rule = text.partition(":")
    key = head.strip().lower().replace("-", "_")
    if key in BLOCK_FORMATS:
        return _block_target(BLOCK_FORMATS[key], rule.strip().lower() if rule else None, name)
    try:
        get_format(text)
        return None
    except PolyampError as err:
        scalar_error = err
    if head.strip().lower().replace("_", "-") in RECIPES:
        return _recipe_target(text)
    raise PolyampError(f"{scalar_error}; measured (the doctor casts each tensor): {accepted()}") from None


def _block_target(bf, rule: str | None, name: str) -> Target:
    if rule is not None and rule not in bf.rules:
        rules = f"one of {', '.join(bf.rules)}" if bf.rules else "none (nvfp4 has one scale rule)"
        raise PolyampError(f"format {name!r}: unknown scale rule {rule!r} for {bf.name}; accepted: {rules}")
    rule = rule or bf.default_rule
    label = bf.name if rule == bf.default_rule else f"{bf.name}:{rule}"
    cast = Cast(bf.name, "block", (bf.block,), rule)
    return Target(label, dict.fromkeys(MEASURED_KINDS, cast))


def _recipe_target(spec: str) -> Target:
    r = parse_recipe(spec)
    if r.kind == "delayed":
        raise PolyampError(f"recipe {r.name!r}: its scale comes from earlier steps' amaxes, which one "
                           f"doctor step does not have; accepted: {accepted()}")  # fmt: skip

    def cast(fmt: str, rounding: str, weight: bool) -> Cast:
        if r.kind == "tensorwise":
            return Cast(fmt, "tensorwise", (), None, rounding, r.margin, float(r.amax_epsilon))
        block = (16, 16) if weight and r.weight_2d else (BLOCK_FORMATS[fmt].block,)
        return Cast(fmt, "block", block, r.scale_rule, rounding)

    fwd = r.forward_format
    casts = {"output": cast(fwd, r.forward_rounding, False), "weight": cast(fwd, r.forward_rounding, True),
             "grad_output": cast(r.backward_format, r.grad_rounding, False)}  # fmt: skip
    return Target(PREFIX + recipe_spec(r), casts)


# -- the statistics ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """Counts and sums of one or more measured tensors (module docstring); they add up."""

    total: int = 0
    nonfinite: int = 0
    nonzero: int = 0
    underflow: int = 0
    clipped: int = 0
    spoiled: int = 0
    err: float = 0.0
    energy: float = 0.0
    extra: dict = field(default_factory=dict, compare=False)

    def merge(self, *others: Measured) -> Measured:
        keys = ("total", "nonfinite", "nonzero", "underflow", "clipped", "spoiled", "err", "energy")
        return Measured(**{k: sum(getattr(m, k) for m in (self, *others)) for k in keys})

    @property
    def rel_mse(self) -> float | None:
        return self.err / self.energy if self.energy > 0 else None

    @property
    def sqnr_db(self) -> float | None:
        r = self.rel_mse
        return None if r is None else (math.inf if r == 0 else -10 * math.log10(r))

    def to_json(self) -> dict:
        def frac(count: int) -> float:
            return count / self.nonzero if self.nonzero else 0.0

        return {"measured": True, "total": self.total, "nonzero": self.nonzero, "nonfinite": self.nonfinite,
                "underflow": frac(self.underflow), "clipped": frac(self.clipped),
                "spoiled": frac(self.spoiled), "rel_mse": self.rel_mse, "sqnr_db": self.sqnr_db}  # fmt: skip


# -- clip thresholds (shared by every path) -----------------------------------------------------------
def plan(cast: Cast, amax: np.ndarray, bad: np.ndarray) -> tuple[np.ndarray, float | None]:
    """Per block, from its amax over the finite elements and whether it holds inf/NaN: the float32
    threshold ``t`` with "clipped" <=> ``|x| > t`` for a float32 |x| (the exact bound rounded down to
    float32, inf where nothing clips), and the tensorwise scale (None for blocks)."""
    amax = np.asarray(amax, np.float64)
    bad = np.asarray(bad, bool)
    if cast.scaling == "tensorwise":
        scale = _tensor_scale(cast, amax, bad)
        return np.full(amax.shape, _tensorwise_bound(cast.format, scale), np.float32), scale
    return _round_down32(_block_bound(cast, amax, bad)), None


def _tensor_scale(cast: Cast, amax: np.ndarray, bad: np.ndarray) -> float:
    a = math.inf if bad.any() else (float(amax.max()) if amax.size else 0.0)
    return float(current_scale(a, cast.format, cast.margin, cast.eps))


def _block_bound(cast: Cast, amax: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Fmax * scale per block (exact, float64): MX ``Fmax * 2^k``; NVFP4 ``6 * s_block * s_global``
    (at most 30 significant bits: exact), inf where ``s_block`` is 0 (the block flushes, nothing clips)
    and in blocks holding inf/NaN."""
    bf = BLOCK_FORMATS[cast.format]
    if bf.scale.name == "e8m0fnu":
        k = _core.exact_float.mx_exponent(_core.xp, amax, bf.element, cast.scale_rule)
        bound = float(bf.element.max) * np.ldexp(1.0, k.astype(np.int32))
    else:
        g = _core.exact_float.nvfp4_global(_core.xp, amax, True)
        unit = np.full(amax.shape, bf.element.max * g)
        s = _core._round_quotient(amax, unit, bf.scale, _MODE["nearest"], 0)
        bound = np.where(s > 0, bf.element.max * s * g, np.inf)
    return np.where(bad, np.inf, bound)


def _round_down32(t: np.ndarray) -> np.ndarray:
    """The largest float32 <= t (a float32 a > t <=> a > that), inf kept."""
    with np.errstate(over="ignore"):
        f = t.astype(np.float32)
    down = np.nextafter(f, np.float32(-np.inf))
    f = np.where(f.astype(np.float64) > t, down, f)
    return np.where(np.isinf(t), np.float32(np.inf), np.where(f > _FLT_MAX, _FLT_MAX, f)).astype(np.float32)


def _tensorwise_bound(fmt: str, scale: float) -> np.float32:
    """The largest float32 a with fp32(a * scale) <= Fmax (clipped <=> |x| > it)."""
    fmax, s = np.float32(get_format(fmt).max), np.float32(scale)
    with np.errstate(over="ignore"):
        a = np.float32(fmax / s)
        while np.float32(a * s) > fmax:
            a = np.nextafter(a, np.float32(0))
        while a < _FLT_MAX and np.float32(np.nextafter(a, np.float32(np.inf)) * s) <= fmax:
            a = np.nextafter(a, np.float32(np.inf))
    return np.float32(a)


# -- the numpy reference ------------------------------------------------------------------------
def as_float32(x) -> np.ndarray:
    """A tensor's values as a float32 numpy array of at least one axis (the measured values)."""
    a = np.asarray(x)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise PolyampError(f"measured tensors are floating point, got dtype {a.dtype}")
    with np.errstate(over="ignore"):
        a = a.astype(np.float32)
    return a.reshape(1) if a.ndim == 0 else a


def cast_numpy(x: np.ndarray, cast: Cast, scale: float | None = None) -> np.ndarray:
    """``x`` (float32) cast as ``cast`` says, by the numpy core."""
    if cast.scaling == "tensorwise":
        with np.errstate(invalid="ignore", over="ignore"):
            return quantize_tensorwise(x, cast.format, scale, cast.rounding, cast.seed)
    block = cast.block_for(x.ndim)
    axis = (-2, -1) if len(block) == 2 else -1
    return quantize_blocks(x, cast.format, axis=axis, block=block, scale_rule=cast.scale_rule,
                           rounding=cast.rounding, seed=cast.seed)  # fmt: skip


def measure(x, cast: Cast) -> Measured:
    """The reference: ``x`` (a numpy array) cast by the numpy core and counted (module docstring)."""
    x = as_float32(x)
    if not x.size:
        return Measured()
    a = np.abs(x.astype(np.float64))
    finite = np.isfinite(a)
    fin = np.where(finite, a, 0.0)
    if cast.scaling == "tensorwise":
        _, scale = plan(cast, fin.max(keepdims=True), np.array([not finite.all()]))
        q = cast_numpy(x, cast, scale).astype(np.float64)
        with np.errstate(over="ignore"):
            clip = np.abs(x) * np.float32(scale) > get_format(cast.format).max  # float32 product
        good = finite
    else:
        block = cast.block_for(x.ndim)
        axes = _core._axes((-2, -1) if len(block) == 2 else -1, x.ndim, len(block))
        amax = _core.exact_float.block_amax(_core.xp, fin, axes, block)
        bad = _core.exact_float.block_amax(_core.xp, np.where(finite, 0.0, 1.0), axes, block) > 0
        bound = _core.exact_float.expand(_core.xp, _block_bound(cast, amax, bad), axes, block, x.shape)
        q = cast_numpy(x, cast).astype(np.float64)
        good = finite & ~_core.exact_float.expand(_core.xp, bad, axes, block, x.shape)
        clip = a > bound
    nonzero = finite & (a != 0)
    ok = nonzero & good
    d = np.where(good, q - x, 0.0)
    return Measured(total=x.size, nonfinite=int((~finite).sum()), nonzero=int(nonzero.sum()),
                    underflow=int((ok & (q == 0)).sum()), clipped=int((ok & clip).sum()),
                    spoiled=int((nonzero & ~good).sum()), err=float((d * d).sum()),
                    energy=float((np.where(good, a, 0.0) ** 2).sum()))  # fmt: skip


# -- on a front end's device ------------------------------------------------------------------------
def measure_on(ops, t, cast: Cast) -> Measured:
    """``measure`` of a front end's tensor on its device, over its ops module (``polyamp.<framework>.xp``,
    section "binning"): ``t`` as float32 (``ops.measured``); each block's finite amax and whether it
    holds inf/NaN (``ops.block_amax``) go to the host for ``plan``; the front end's kernels cast
    (``ops.measure_cast``), and the counts and float64 sums are taken on the device (``ops.block_stats``,
    told whether any block is spoiled), in the zero-padded blocked view of ``blocked`` (padding is zero:
    never counted)."""
    x = ops.measured(t)
    n = ops.numel(x)
    if not n:
        return Measured()
    block = cast.block_for(x.ndim)
    tiles = block if cast.scaling == "block" else ()
    amax, bad = ops.block_amax(x, tiles)
    thr, scale = plan(cast, amax, bad)
    q = ops.measure_cast(x, cast, block, scale)
    counts, sums = ops.block_stats(x, q, thr, tiles, cast.scaling == "block", bool(bad.any()))
    return Measured(n, *(int(c) for c in counts), *(float(v) for v in sums))


def blocked(ops, x, block: tuple[int, ...]):
    """``x`` zero-padded and viewed as blocks, and the axes a block spans: () -> the whole tensor one
    block; (B,) -> blocks of B along the last axis; (16, 16) -> tiles of the last two axes."""
    if not block:
        return x.reshape(1, -1), (1,)
    if len(block) == 1:
        (b,) = block
        x2 = x.reshape(-1, x.shape[-1])
        x2 = ops.zero_pad_end(x2, (0, -x2.shape[1] % b))
        return x2.reshape(x2.shape[0], -1, b), (2,)
    h, w = x.shape[-2:]
    x3 = ops.zero_pad_end(x.reshape(-1, h, w), (0, -h % block[0], -w % block[1]))
    tiles = (x3.shape[0], x3.shape[1] // block[0], block[0], x3.shape[2] // block[1], block[1])
    return x3.reshape(tiles), (2, 4)


KERNEL_KINDS = ("weight", "grad_weight")


def gemm_layout(x, kind: str):
    """A JAX / Keras 2-d kernel ``(in, out)`` (or its gradient) transposed, so that blocks run along
    ``in``, the GEMM's reduction axis; other tensors as they are."""
    return x.T if kind in KERNEL_KINDS and x.ndim == 2 else x


def measure_all(x, kind: str, targets: tuple[Target, ...]) -> dict[str, Measured]:
    """``measure`` of a numpy array under each target that measures ``kind`` (TensorFlow, MXNet)."""
    return {t.label: measure(x, t.casts[kind]) for t in targets if kind in t.casts}


class Meter:
    """A front end's measurements: ``add(layer, kind, tensor)`` measures ``convert(tensor)`` (a numpy
    copy, ``measure``) under each target; ``parts[(layer, kind)][label]`` lists them."""

    def __init__(self, targets: tuple[Target, ...], convert, kernels_in_out: bool = False):
        self.targets, self.convert, self.kernels_in_out = targets, convert, kernels_in_out
        self.parts: dict = defaultdict(lambda: defaultdict(list))

    def add(self, layer: str, kind: str, x) -> None:
        if self.targets and any(kind in t.casts for t in self.targets):
            x = self.convert(x)
            x = gemm_layout(x, kind) if self.kernels_in_out else x
            for label, m in measure_all(x, kind, self.targets).items():
                self.parts[layer, kind][label].append(m)


def merged(parts: dict[tuple[str, str], dict[str, list[Measured]]], key) -> dict[str, Measured]:
    """A (layer, kind)'s measurements, each label's merged."""
    return {label: ms[0].merge(*ms[1:]) for label, ms in parts.get(key, {}).items() if ms}


__all__ = ["KERNEL_KINDS", "MEASURED_KINDS", "PREFIX", "Cast", "Measured", "Target", "accepted",
           "gemm_layout", "measure", "parse", "plan"]
