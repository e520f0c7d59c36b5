"""``quantize``, ``quantize_blocks`` and the recipes' per-tensor scaling on MXNet NDArrays, bit-identical
to the numpy core, in MXNet ops (``mx.np`` ones, which contrib.amp does not patch); the data stays on
its device (block formats read two per-block flags and NVFP4's global amax, one number each).

Takes and gives the arguments and values of ``polyamp.numerics.rounding`` / ``blocks`` /
``polyamp.recipes`` (read those docstrings for the rules). MXNet 1.9 has no bitcast and no shifts, its
``rint`` rounds a tie down (1.5 -> 1) and ``round`` away from zero, and it hands a scalar operand to
its kernels as a 16-digit decimal (``_k``); so the steps are float64 arithmetic (every float16 /
bfloat16 / float32 value converts exactly, and float64 input is rounded from its own value):

1. ``e`` = ``frexp``'s exponent of ``a = |x|`` minus one (``floor(log2 a)``, exact), clamped to the
   format's ``[emin, emax + 1]``; ``q = 2^(e - mbits)`` and ``t = a / q``, exact (a power of two);
2. nearest: ``(t + 2^52) - 2^52``, which rounds ties to even for ``0 <= t < 2^52`` (a larger ``t``
   overflows the format either way); stochastic: ``floor(t) + 1`` when ``u < t - floor(t)``, with ``u``
   the core's splitmix64 stream of (seed, flat element index) in int64 (wrapping multiplies; the
   logical right shift is the masked value's truncating division plus the sign bit's share);
3. overflow, inf and NaN as the core's ``_quantize_numpy`` (saturating: ``minimum(r, max)``, which
   keeps NaN), the sign by multiplying with ``1 - 2 signbit(x)`` (MXNet's ``copysign`` ignores -0),
   -0, the unsigned and zero-less formats; the result dtype is the core's.

Block formats follow ``blocks.py`` step for step in float64: block amax (zero padded; ``max`` lets NaN
win), the MX scale exponent by the rules on ``k`` clamped to [-128, 127] (the final clamp to [-127, 127]
decides the rest), NVFP4's float32 global scale (the float64 quotient cast to float32 rounds as the
exact one for a float32 amax; float64 input uses the core's exact computation), the element rounding
above indexed by position in ``x``, then ``element * scale (* global)`` rounded once to the result
dtype. Full-size ``where`` is MXNet's slowest elementwise op here, so the NaN-block and zero-scale
fixes run only when a block needs them.

Tensorwise (``recipes.quantize_tensorwise``): ``fp32(x * scale)`` rounded with saturation, divided by
``scale`` in float32; :func:`current_scale` is ``recipes.current_scale`` of an amax array.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from ..errors import PolyampError
from ..numerics import blocks as _blocks
from ..numerics.formats import FloatFormat, get_format
from ..numerics.rounding import _MODE, _mix, _result_name, _rounding, _seed
from ..numerics.rounding import arguments as _arguments
from .keep import dtype_name

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet.contrib import amp

mnp = mx.np
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_U64 = 1 << 64
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_TWO52 = 2.0**52
_FLT_MAX = float(np.finfo(np.float32).max)


def _k(value: float, like, dtype: str = "float64"):
    """``value`` as an operand next to ``like``: the number itself when it has a short decimal form,
    else a (1,) array (MXNet passes a scalar operand to its kernel as a decimal string and reads
    2^-127 back as 5.877471754111439e-39, bf16's max as 3.389531389251535e+38)."""
    value = float(value)
    if not math.isfinite(value) or float(f"{value:.12g}") == value:
        return value
    return mnp.array(np.array([value], dtype=dtype), ctx=like.ctx)


def accepts(x) -> bool:
    """Whether ``x`` is an array this module quantizes (the core's dispatch asks)."""
    return isinstance(x, mx.nd.NDArray)


def quantize(x, fmt, rounding: str = "nearest", saturate: bool = False, seed: int | None = None):
    """``polyamp.quantize`` for an MXNet NDArray: same values, bits and dtype rule, on ``x``'s context."""
    fmt, mode, saturate, seed = _arguments(fmt, rounding, saturate, seed)
    v, name = _input(x, "quantize")
    out = _round(v, fmt, mode, saturate, seed or 0)
    return _output(out, _result_name(name, fmt), x)


def quantize_blocks(x, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                    rounding: str = "nearest", seed: int | None = None):  # fmt: skip
    """``polyamp.quantize_blocks`` for an MXNet NDArray: same values and bits, float32 unless x is
    float64."""
    bf, mode, seed, rule = _blocks.arguments(fmt, scale_rule, rounding, seed)
    x64, name = _input(x, "quantize_blocks")
    shape = _blocks._block_shape(bf, block)
    axes = _blocks._axes(axis, x64.ndim, len(shape))
    seed = seed or 0
    a = mnp.abs(x64)
    amax = _block_amax(a, axes, shape)
    bad = mnp.logical_not(mnp.isfinite(amax))  # NaN / inf blocks: scale NaN, elements 0
    any_bad = _any(bad)  # (full-size where() is slow in MXNet: only when needed)
    if any_bad:
        amax = mnp.where(bad, 0.0, amax)
        x64 = mnp.where(_expand(bad, axes, shape, x64.shape), 0.0, x64)
    g = None
    if bf.scale.name == "e8m0fnu":
        k = _mx_exponent(amax, bf.element, rule)
        scales = mnp.power(2.0, k)
        scaled = x64 * _expand(mnp.power(2.0, -k), axes, shape, x64.shape)  # exact
        elements = _round(scaled, bf.element, mode, True, seed)
    else:
        g = _nvfp4_global(a, name)
        scales = _round(amax / _k(bf.element.max * g, amax), bf.scale, _MODE["nearest"], True, 0)
        if _any(scales == 0):  # s_block rounded to 0: the block holds +-0 (x64 is finite here)
            x64 = mnp.where(_expand(scales == 0, axes, shape, x64.shape), x64 * 0.0, x64)
            scales = mnp.where(scales == 0, 1.0, scales)
        elements = _round(x64 / (_expand(scales, axes, shape, x64.shape) * _k(g, x64)), bf.element, mode,
                          True, seed)  # fmt: skip
    if any_bad:
        scales = mnp.where(bad, math.nan, scales)
    v = elements * _expand(scales, axes, shape, elements.shape)
    if g is not None:
        v = v * _k(g, v)
    return _output(v, "float64" if name == "float64" else "float32", x)


def current_scale(amax, fmt, margin: int = 0, eps: float = 0.0):
    """``polyamp.recipes.current_scale`` of a float32 amax array (``mx.np``, any shape), as MXNet ops."""
    scaled_max = float(np.float32(float(get_format(fmt).max) * 2.0**-margin))
    a = amax.astype("float64")
    a = mnp.where(a < _k(eps, a), _k(eps, a), a)
    q = (_k(scaled_max, a) / a).astype("float32")  # the float64 quotient rounded once to float32: as the core
    q = mnp.where(mnp.isinf(q), _k(_FLT_MAX, q, "float32"), q)
    return mnp.where(mnp.isfinite(a) & (a > 0), q, 1.0).astype("float32")


def amax(x) -> mx.np.ndarray:
    """max |x| as a float32 array of shape (1,) (NaN if x holds one)."""
    return mnp.max(mnp.abs(_as_np(x).astype("float32")), keepdims=True).reshape((1,))


def quantize_tensorwise(x, fmt, scale, rounding: str = "nearest", seed: int | None = None):
    """``polyamp.recipes.quantize_tensorwise`` for an NDArray: ``quantize(fp32(x * scale), fmt,
    saturate=True) / scale`` in float32; ``scale`` a float32 array of one element (``current_scale``)
    or a finite number > 0. Returns float32."""
    mode = _rounding(rounding)
    if mode == _MODE["stochastic"]:
        seed = _seed(seed)
    fmt = get_format(fmt)
    if isinstance(scale, mx.nd.NDArray):
        s = _as_np(scale).astype("float32").reshape((1,))
    else:
        if not (isinstance(scale, (int, float, np.floating)) and not isinstance(scale, bool)
                and 0 < scale < math.inf and np.isfinite(np.float32(scale))):  # fmt: skip
            raise PolyampError(f"scale must be a finite number > 0 (float32); received {scale!r}")
        s = mnp.array(np.array([scale], dtype=np.float32), ctx=x.ctx)
    v, _ = _input(x, "quantize_tensorwise")
    y = v.astype("float32") * s
    q = _round(y.astype("float64"), fmt, mode, True, seed or 0).astype("float32")
    return (q / s).as_nd_ndarray()


# -- scalar rounding ------------------------------------------------------------------------------
def _round(v, fmt: FloatFormat, mode: int, saturate: bool, seed: int):
    """float64 ``v`` (``mx.np``) rounded onto ``fmt`` (module docstring), float64 out; stochastic:
    by flat index."""
    overflow = fmt.max if (saturate or fmt.saturates_always) else (math.inf if fmt.has_inf else math.nan)
    mbits = fmt.mbits
    a = mnp.abs(v)
    maxval, overflow = _k(fmt.max, v), _k(overflow, v)
    _, e2 = mnp.frexp(a)  # a = m * 2^e2 with m in [0.5, 1): floor(log2 a) = e2 - 1
    e = mnp.clip(e2.astype("float64") - 1.0, fmt.emin, fmt.emax + 1)
    q = mnp.power(2.0, e - mbits)
    t = a / q  # exact: q is a power of two
    nearest = (t + _TWO52) - _TWO52  # ties to even (module docstring)
    if mode == _MODE["nearest"]:
        r = nearest * q
    elif mode == _MODE["toward_zero"]:
        r = mnp.floor(t) * q
    else:
        f = mnp.floor(t)
        u = _uniform53(_mix(seed), v.size, v.ctx).reshape(v.shape)
        r = (f + (u < t - f).astype("float64")) * q
    if saturate or fmt.saturates_always:
        r = mnp.minimum(r, maxval)  # also inf -> max; NaN stays NaN (minimum propagates it)
    else:  # where() is MXNet's slowest elementwise op here: only on this path
        over = r > maxval
        r = mnp.minimum(r, maxval)
        if mode != _MODE["toward_zero"]:  # past max where nearest is too (toward zero never overflows)
            r = mnp.where(over & (nearest * q > maxval), overflow, r)
        r = mnp.where(a == math.inf, overflow, r)
    r = r * (1.0 - 2.0 * mnp.signbit(v).astype("float64"))  # copysign, -0 included (r >= 0 or NaN)
    if not fmt.has_negative_zero:
        r = r + 0.0  # -0 + 0 is +0
    if not fmt.signed:
        r = mnp.where(v < 0, math.nan, r)
    if not fmt.subnormals:
        tiny = (a > 0) & (r == 0)
        r = mnp.where(a == 0, math.nan, mnp.where(tiny, _k(fmt.min_normal, v), r))
    return r


def _int64(c: int):
    """A constant as a (1,) int64 array (MXNet passes a scalar operand as a double, which would round it)."""
    return mnp.array(np.array([c - _U64 if c >= 1 << 63 else c], dtype=np.int64))


def _uniform53(key: int, n: int, ctx):
    """The core's ``_uniform53`` of indices 0..n-1 in int64: splitmix64(key + (i+1)*golden) >> 11,
    times 2^-53 (int64 multiplies wrap as uint64's do)."""
    i = mnp.arange(1, n + 1, dtype="int64", ctx=ctx)
    z = i * _int64(_GOLDEN).as_in_ctx(ctx) + _int64(key).as_in_ctx(ctx)
    z = mnp.bitwise_xor(z, _shr(z, 30)) * _int64(_M1).as_in_ctx(ctx)
    z = mnp.bitwise_xor(z, _shr(z, 27)) * _int64(_M2).as_in_ctx(ctx)
    z = mnp.bitwise_xor(z, _shr(z, 31))
    return _shr(z, 11).astype("float64") * _k(2.0**-53, z)


def _shr(z, s: int):
    """Logical right shift of int64 bit patterns: the low 63 bits divided by 2^s (a truncating integer
    division, exact on values >= 0), plus the sign bit's 2^(63 - s)."""
    ctx = z.ctx
    low = mnp.bitwise_and(z, _int64((1 << 63) - 1).as_in_ctx(ctx)).as_nd_ndarray()
    shifted = mx.nd.broadcast_div(low, _int64(1 << s).as_in_ctx(ctx).as_nd_ndarray()).as_np_ndarray()
    return shifted + (z < 0).astype("int64") * (1 << (63 - s))


# -- block formats --------------------------------------------------------------------------------
def _any(flags) -> bool:
    """Whether any of the (per-block) flags is set: one host read."""
    return bool(mnp.max(flags.astype("float32"), keepdims=True).asnumpy().max() > 0)


def _mx_exponent(amax, elem: FloatFormat, rule: str):
    """The E8M0 exponent per block (``blocks._mx_exponent``) as float64 integers; ``amax`` finite, >= 0."""
    _, e2 = mnp.frexp(amax)
    k = mnp.clip(e2.astype("float64") - 1.0 - elem.emax, -128, 127)  # the final clamp decides beyond
    e = k + elem.emax
    if rule == "rceil":
        k = k + (amax > _k(elem.max, amax) * mnp.power(2.0, k)).astype("float64")
    elif rule == "ceil":
        k = k + (amax > mnp.power(2.0, e)).astype("float64")
    elif rule == "even":
        top = _k(2.0 - 2.0 ** -(elem.mbits + 1), amax)
        k = k + (amax >= top * mnp.power(2.0, e)).astype("float64")
    return mnp.clip(mnp.where(amax == 0, -127.0, k), -127, 127)


def _nvfp4_global(a, name: str) -> float:
    """float32(amax / 2688) over the finite elements; 1 without a finite non-zero one. A host read
    (one number), as NVFP4's global scale multiplies every block scale."""
    finite = mnp.where(mnp.isfinite(a), a, 0.0)
    amax = float(mnp.max(finite, keepdims=True).asnumpy().max())
    if name == "float64":  # a 53-bit amax needs the exact quotient: the core's
        return _blocks._nvfp4_global(np.array([amax]))
    if amax == 0:
        return 1.0
    return max(float(np.float32(amax / _blocks._NVFP4_RANGE)), 2.0**-149)


def _block_amax(a, axes: tuple[int, ...], shape: tuple[int, ...]):
    """max |x| over each block (NaN wins), in the scales' layout; a partial block is zero padded."""
    nb = len(axes)
    lead = a.ndim - nb
    moved = mnp.moveaxis(a, axes, tuple(range(lead, a.ndim)))
    sizes = moved.shape[lead:]
    counts = [-(-n // b) for n, b in zip(sizes, shape)]
    pad = [(0, 0)] * lead + [(0, c * b - n) for n, b, c in zip(sizes, shape, counts)]
    if any(p[1] for p in pad):
        moved = mnp.pad(moved, tuple(pad))
    split = list(moved.shape[:lead])
    for c, b in zip(counts, shape):
        split += [c, b]
    blocked = moved.reshape(tuple(split))
    amax = mnp.max(blocked, axis=tuple(lead + 2 * i + 1 for i in range(nb)))
    return mnp.moveaxis(amax, tuple(range(lead, a.ndim)), axes)


def _expand(per_block, axes, shape, full):
    """Each block's entry repeated over its elements: the scales' layout -> x's layout."""
    out = per_block
    for ax, b in zip(axes, shape):
        out = mnp.repeat(out, b, axis=ax)
        if out.shape[ax] != full[ax]:
            out = out[(slice(None),) * ax + (slice(0, full[ax]),)]
    return out


# -- arguments ------------------------------------------------------------------------------------
def _input(x, what: str):
    """``x`` as a float64 ``mx.np`` array (exact), and its dtype's name."""
    if not isinstance(x, mx.nd.NDArray):
        raise PolyampError(f"{what} takes an mxnet NDArray here, got {type(x).__module__}.{type(x).__name__}")
    name = dtype_name(x.dtype)
    if name not in _FLOATS:
        raise PolyampError(
            f"expected a floating-point NDArray, got dtype {name}; accepted: {', '.join(_FLOATS)}"
        )
    if x.size == 0:
        raise PolyampError(f"{what} takes a non-empty NDArray (MXNet 1.9 has no zero-size arrays); got "
                           f"shape {x.shape}")  # fmt: skip
    return _as_np(x).astype("float64"), name


def _as_np(x):
    """An NDArray as an ``mx.np`` array (shared memory); bfloat16 widened to float32 (mx.np has no bf16)
    by ``Cast``, exact (oneDNN's ``amp_cast`` turns -0 into +0 on CPUs without AVX-512)."""
    if dtype_name(x.dtype) == "bfloat16":
        x = mx.nd.cast(x.as_nd_ndarray(), dtype="float32")
    return x if isinstance(x, mx.np.ndarray) else x.as_np_ndarray()


def _output(v, name: str, like):
    """``v`` in dtype ``name`` as the kind of array ``like`` is (an NDArray, or an ``mx.np`` array).

    A bfloat16 result holds bf16 values already, which ``Cast`` (it truncates) keeps bit for bit;
    oneDNN's ``amp_cast`` (it rounds) flushes subnormals and turns -0 into +0 on CPUs without AVX-512."""
    if name == "bfloat16":
        out = mx.nd.cast(v.astype("float32").as_nd_ndarray(), dtype=amp.amp.bfloat16)
    else:
        out = v.astype(name).as_nd_ndarray()
    return out.as_np_ndarray() if isinstance(like, mx.np.ndarray) else out


__all__ = ["accepts", "amax", "current_scale", "quantize", "quantize_blocks", "quantize_tensorwise"]
