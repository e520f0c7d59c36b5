"""MX and NVFP4 block formats: one shared scale per block of elements, every rounding exact.

A block format stores each element as a small float (the *element format*) and one *scale* per block
of consecutive elements along ``axis``. A value is ``element * scale`` (NVFP4: ``element * scale *
global_scale``).

============  =======  =====  =======  =========================================
format        element  block  scale    scale rules
============  =======  =====  =======  =========================================
mxfp8_e4m3    e4m3fn   32     e8m0fnu  floor (default, OCP v1.0), rceil, ceil, even
mxfp8_e5m2    e5m2     32     e8m0fnu  same
mxfp6_e3m2    e3m2fn   32     e8m0fnu  same
mxfp6_e2m3    e2m3fn   32     e8m0fnu  same
mxfp4         e2m1fn   32     e8m0fnu  same
nvfp4         e2m1fn   16     e4m3fn   one rule (TE's); 1x16 blocks, or 16x16 with ``block=(16, 16)``
============  =======  =====  =======  =========================================

The block size is part of the format (OCP MX v1.0 fixes k = 32 for its concrete formats, NVFP4 is
16): any other ``block`` is refused.

MX, per block, with ``amax = max |x|``, ``E = floor(log2 amax)`` and the element format's largest
exponent ``emax``, largest value ``Fmax`` and mantissa bits ``m``:

1. the scale exponent ``k``, by ``scale_rule``:
   floor  ``E - emax`` (OCP MX v1.0's conversion); the amax lands in [2^emax, 2^(emax+1)) and clips
          above Fmax: by up to 12.5 % for E4M3 (448 of 512), 25 % for E2M1 (6 of 8).
   rceil  ``ceil(log2(amax / Fmax))``: the smallest k with ``amax <= Fmax * 2^k``; the amax never
          clips (NVIDIA's MXFP8 recipe; cuBLAS / TE round the E8M0 scale toward +inf).
   ceil   ``ceil(log2 amax) - emax`` (torchao ``ScaleCalculationMode.CEIL``).
   even   ``floor(log2(amax rounded to m mantissa bits)) - emax`` (torchao ``EVEN``): E - emax, plus
          one when ``amax >= 2^E * (2 - 2^-(m+1))``.
   Then clamped to E8M0's range [-127, 127].
2. each ``x / 2^k`` (exact) is rounded to the element format, ties to even or stochastically,
   saturating at +-Fmax; 3. the value is ``element * 2^k``.

NVFP4 (TransformerEngine ``NVFP4BlockScaling``, ``docs/features/low_precision_training/nvfp4``):

1. ``s_global = amax / (448 * 6)`` over the tensor's finite elements, rounded once to float32;
2. per block ``s_block = (amax_block / 6) / s_global`` rounded once to e4m3fn (ties to even,
   saturating at 448);
3. each ``x / (s_block * s_global)`` rounded once to e2m1fn (ties to even or stochastic, saturating);
4. the value is ``element * s_block * s_global``.

Each quotient is rounded once from its exact value: MX divides by a power of two (exact); NVFP4
divides in float64, whose quotient rounds like the exact one (see ``_round_quotient``). Stochastic
rounding draws from ``quantize``'s counter-based stream, indexed by the element's position in
``x``; for NVFP4 its probability comes from the float64 quotient (relative error below 2^-52).

Edge cases:

- an all-zero block: MX scale 2^-127 (E8M0 code 0), NVFP4 block scale 0; its elements are +-0.
- a block holding NaN or +-inf: its scale is NaN (E8M0 code 0xFF, e4m3fn code 0x7F) and every value
  of the block is NaN; its element codes are 0. OCP MX v1.0 makes every element of a block with a
  NaN scale NaN; microxcaling (``mx/mx_ops.py``) and torchao (``mx_tensor.py::to_mx``) both give a
  block whose amax is NaN or inf the NaN scale. NVFP4's global amax skips non-finite elements, so a
  bad block spoils only itself.
- a trailing partial block is padded with zeros for its amax; results keep ``x``'s shape, and
  there are ceil(n / block) scales along each blocked axis.
- E8M0 clamp: a block with amax below 2^(emax - 127) gets 2^-127 and its elements become subnormal
  or 0; a scale above 2^127 (float64 input with amax >= 2^(128 + emax) only) is clamped to 2^127
  and the elements saturate, where microxcaling would give NaN.
- NVFP4: a block whose ``s_block`` rounds to 0 holds +-0; a tensor with no finite non-zero
  element has ``s_global = 1``; an ``s_global`` that underflows float32 becomes 2^-149.
- result dtype: float32 and float64 inputs keep theirs; float16 and bfloat16 inputs come back as
  float32 (no 16-bit dtype holds every value of a block format, e.g. anything scaled by 2^-127).
  A value beyond float32's range (only ``|x|`` within one element step of float32's max under
  rceil or ceil: mxfp4 of 3.4e38 is 4 * 2^126 = 2^128) becomes inf, as a float32 cast does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PolyampError, invalid
from . import exact_float, xp
from .codes import decode, encode
from .formats import FORMATS, FloatFormat
from .rounding import _MODE, _as_float_array, _framework_tensor, _quantize_array, _rounding, _seed

SCALE_RULES = ("floor", "rceil", "ceil", "even")


@dataclass(frozen=True)
class BlockFormat:
    """A block format: element format, scale format, block size and accepted scale rules."""

    name: str
    element: FloatFormat
    scale: FloatFormat
    block: int
    rules: tuple[str, ...]
    default_rule: str | None
    blocks_2d: bool = False

    @property
    def blocks(self) -> tuple[tuple[int, ...], ...]:
        """The accepted ``block`` shapes."""
        return ((self.block,), (self.block, self.block)) if self.blocks_2d else ((self.block,),)


def _mx(name: str, element: str) -> BlockFormat:
    return BlockFormat(name, FORMATS[element], FORMATS["e8m0fnu"], 32, SCALE_RULES, "floor")


BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        _mx("mxfp8_e4m3", "e4m3fn"),
        _mx("mxfp8_e5m2", "e5m2"),
        _mx("mxfp6_e3m2", "e3m2fn"),
        _mx("mxfp6_e2m3", "e2m3fn"),
        _mx("mxfp4", "e2m1fn"),
        BlockFormat("nvfp4", FORMATS["e2m1fn"], FORMATS["e4m3fn"], 16, (), None, blocks_2d=True),
    )
}


@dataclass(frozen=True, eq=False)
class Blocks:
    """``x`` encoded in a block format (from ``encode_blocks``; ``decode_blocks`` reads it back).

    ``elements``: element codes (uint8, the element format's bits), ``x``'s shape.
    ``scales``: scale codes (uint8: E8M0 for MX, e4m3fn for NVFP4), ``x``'s shape with each blocked
    axis of length n replaced by ceil(n / block): ``scales[..., j, ...]`` scales
    ``elements[..., j*block:(j+1)*block, ...]`` along that axis.
    ``global_scale``: NVFP4's float32 per-tensor scale, None for MX.
    ``axes``: the blocked axes of ``x`` (non-negative; two for 16x16 blocks), ``block`` their sizes,
    ``dtype`` the dtype ``decode_blocks`` returns.
    """

    format: str
    scale_rule: str | None
    axes: tuple[int, ...]
    block: tuple[int, ...]
    dtype: np.dtype
    elements: np.ndarray
    scales: np.ndarray
    global_scale: np.float32 | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.elements.shape


def quantize_blocks(x, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                    rounding: str = "nearest", seed: int | None = None) -> np.ndarray:  # fmt: skip
    """Round ``x`` onto the block format ``fmt`` and return the values (see the module docstring).

    ``axis``: the axis the blocks run along (an int); for 16x16 blocks a pair (default: the last
    two axes). ``block``: None (the format's), or the format's own size (32; nvfp4: 16 or (16, 16)).
    ``scale_rule``: MX only, "floor" (default), "rceil", "ceil" or "even". ``rounding``: "nearest"
    (ties to even) or "stochastic" (``seed`` makes it reproducible).

    >>> quantize_blocks([480.0, 1.0] + [0.0] * 30, "mxfp8_e4m3")[:2].tolist()  # 480 clips
    [448.0, 1.0]
    >>> quantize_blocks([480.0, 1.0] + [0.0] * 30, "mxfp8_e4m3", scale_rule="rceil")[:2].tolist()
    [480.0, 1.0]
    """
    ops = _framework_tensor(x)
    if ops is not None:
        bf, mode, seed, rule = arguments(fmt, scale_rule, rounding, seed)
        shape = _block_shape(bf, block)
        return ops.round_to_blocks(x, bf, _axes(axis, _ndim(x), len(shape)), shape, rule, mode, seed)
    enc = _Encoding.of(x, fmt, axis, block, scale_rule, rounding, seed)
    return _values(enc.axes, enc.block, enc.elements, enc.scales, enc.global_scale, enc.dtype)


def encode_blocks(x, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                  rounding: str = "nearest", seed: int | None = None) -> Blocks:  # fmt: skip
    """Round ``x`` as ``quantize_blocks`` does and return the codes as a ``Blocks``.

    ``decode_blocks(encode_blocks(x, ...))`` equals ``quantize_blocks(x, ...)`` bit for bit.
    """
    enc = _Encoding.of(x, fmt, axis, block, scale_rule, rounding, seed)
    bf = enc.bf
    elements = encode(enc.elements, bf.element)
    scales = encode(enc.scales, bf.scale)
    g = None if enc.global_scale is None else np.float32(enc.global_scale)
    return Blocks(bf.name, enc.rule, enc.axes, enc.block, enc.dtype, elements, scales, g)


def decode_blocks(blocks: Blocks) -> np.ndarray:
    """The values of a ``Blocks``: element * scale (* global scale), in ``blocks.dtype``."""
    if not isinstance(blocks, Blocks):
        raise PolyampError(f"decode_blocks takes a Blocks (from encode_blocks), got {type(blocks).__name__}")
    bf = _block_format(blocks.format)
    elements, scales = np.asarray(blocks.elements), np.asarray(blocks.scales)
    want = list(elements.shape)
    for a, b in zip(blocks.axes, blocks.block):
        want[a] = -(-want[a] // b)
    if scales.shape != tuple(want):
        raise PolyampError(
            f"Blocks.scales has shape {scales.shape}; accepted: {tuple(want)} for elements of shape "
            f"{elements.shape} in blocks of {blocks.block} along axes {blocks.axes}"
        )
    g = None if blocks.global_scale is None else float(blocks.global_scale)
    values = decode(elements, bf.element)
    return _values(blocks.axes, blocks.block, values, decode(scales, bf.scale), g, np.dtype(blocks.dtype))


# -- the algorithm ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Encoding:
    """Element values (on the element grid, x's layout), scale values (scales' layout), global scale."""

    bf: BlockFormat
    rule: str | None
    axes: tuple[int, ...]
    block: tuple[int, ...]
    dtype: np.dtype
    elements: np.ndarray
    scales: np.ndarray
    global_scale: float | None

    @classmethod
    def of(cls, x, fmt, axis, block, scale_rule, rounding, seed) -> _Encoding:
        bf, mode, seed, rule = arguments(fmt, scale_rule, rounding, seed)
        arr = _input(x)
        shape = _block_shape(bf, block)
        axes = _axes(axis, arr.ndim, len(shape))
        dtype = arr.dtype if arr.dtype.itemsize >= 4 else np.dtype(np.float32)
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            x64, wide = arr.astype(np.float64), dtype == np.float64
            elements, scales, g = exact_float.encode_blocks(
                xp, x64, bf, axes, shape, rule, mode, seed or 0, wide, _round_saturated
            )
        return cls(bf, rule, axes, shape, dtype, elements, scales, None if g is None else float(g))


def _round_saturated(v: np.ndarray, fmt: FloatFormat, mode: int, seed: int, narrow: bool) -> np.ndarray:
    """The core's rounding (numba kernel, else ``exact_float.round_float64`` over numpy), saturating."""
    return _quantize_array(v, fmt, mode, True, seed)


def _round_quotient(num: np.ndarray, den: np.ndarray, fmt: FloatFormat, mode: int, seed: int) -> np.ndarray:
    """``num / den`` rounded once onto ``fmt`` (saturating), through the float64 quotient ``t``.

    Exact for nearest: ``t`` differs from the exact quotient only where that is not on ``fmt``'s
    grid, and can land on a grid midpoint ``m`` only if ``num == m * den``. (``m * den`` is a float64
    here, as ``m`` has at most 5 significant bits and ``den`` 28; any other float64 ``num`` is at
    least one float64 step from it, which moves the quotient by more than half a step at ``m``.)
    So ``t`` rounds like the exact quotient (``exact_float.encode_blocks`` divides so);
    ``benchmarks/blocks_reference.py`` checks it.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        t = num / den
    return _quantize_array(t, fmt, mode, True, seed)


def _values(axes, shape, elements, scales, g, dtype) -> np.ndarray:
    """element * scale (* global scale) in float64 (exact), then one rounding to ``dtype``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return exact_float.block_values(xp, axes, shape, elements, scales, g).astype(dtype)


# -- argument checking ----------------------------------------------------------------------------
def arguments(fmt, scale_rule, rounding, seed) -> tuple[BlockFormat, int, int | None, str | None]:
    """The block format, rounding mode, seed and scale rule of a call, validated (front ends' kernels
    take the same)."""
    bf = _block_format(fmt)
    mode = _rounding(rounding)
    if mode not in (_MODE["nearest"], _MODE["stochastic"]):
        raise PolyampError(f"block formats round 'nearest' or 'stochastic', got rounding={rounding!r}")
    if mode == _MODE["stochastic"]:
        seed = _seed(seed)
    elif seed is not None:
        _seed(seed)  # validated even when unused, as quantize does
    return bf, mode, seed, _scale_rule(bf, scale_rule)


def _block_format(fmt) -> BlockFormat:
    key = fmt.strip().lower().replace("-", "_") if isinstance(fmt, str) else None
    if key not in BLOCK_FORMATS:
        raise invalid("block format", fmt, list(BLOCK_FORMATS))
    return BLOCK_FORMATS[key]


def _scale_rule(bf: BlockFormat, rule) -> str | None:
    if not bf.rules:
        if rule is not None:
            raise PolyampError(
                f"{bf.name} has one scale rule (s_block = amax_block / 6 / s_global in e4m3fn), got "
                f"scale_rule={rule!r}; accepted: None (scale rules {', '.join(SCALE_RULES)} are for MX)"
            )
        return None
    if rule is None:
        return bf.default_rule
    key = rule.strip().lower() if isinstance(rule, str) else rule
    if key not in bf.rules:
        raise invalid("scale rule", rule, bf.rules)
    return key


def _block_shape(bf: BlockFormat, block) -> tuple[int, ...]:
    if block is None:
        return (bf.block,)
    shape = (block,) if isinstance(block, (int, np.integer)) else block
    ok = isinstance(shape, (tuple, list)) and all(
        isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_)) for b in shape
    )
    if ok and tuple(int(b) for b in shape) in bf.blocks:
        return tuple(int(b) for b in shape)
    accepted = " or ".join(str(b[0]) if len(b) == 1 else str(b) for b in bf.blocks)
    raise PolyampError(
        f"block {block!r} does not match {bf.name}; accepted: {accepted} (or None). The block size is "
        "part of the format"
    )


def _axes(axis, ndim: int, count: int) -> tuple[int, ...]:
    def one(a) -> int:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)) or not -ndim <= a < ndim:
            raise PolyampError(
                f"axis {axis!r} is not an axis of a {ndim}-d array; accepted: integers in [{-ndim}, {ndim})"
                + (" (a 0-d input has no axis to block along)" if ndim == 0 else "")
            )
        return int(a) % ndim

    if count == 1:
        return (one(axis),)
    pair = (-2, -1) if (isinstance(axis, (int, np.integer)) and axis == -1) else axis
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or ndim < 2:
        raise PolyampError(
            f"16x16 blocks tile two axes; got axis={axis!r} for a {ndim}-d array; accepted: a pair of "
            "distinct axes such as (-2, -1) (the default), on an array of 2 or more dimensions"
        )
    axes = (one(pair[0]), one(pair[1]))
    if axes[0] == axes[1]:
        raise PolyampError(f"16x16 blocks tile two distinct axes, got axis={axis!r}")
    return axes


def _ndim(x) -> int:
    """The number of dimensions of a framework tensor (its shape's length; it must be known)."""
    try:
        return len(x.shape)
    except (TypeError, ValueError):
        raise PolyampError(f"quantize_blocks needs a static shape, got {x.shape}") from None


def _input(x) -> np.ndarray:
    if type(x).__module__.split(".")[0] in ("torch", "tensorflow", "jax", "jaxlib", "mxnet"):
        raise PolyampError(
            f"quantize_blocks takes numpy arrays, torch/TF/JAX/MXNet tensors, got a {type(x).__module__}."
            f"{type(x).__name__} (no kernel for it yet); convert it with np.asarray (or .numpy()) first"
        )
    return _as_float_array(x)
