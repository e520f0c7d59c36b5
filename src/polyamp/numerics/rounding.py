"""Exact rounding of arrays onto a low-precision format ("fake quantisation").

Algorithm, on the exact value ``a = |x|`` (every supported input converts to float64 exactly):

1. ``q = 2^(max(floor(log2 a), emin) - mbits)`` is the format's spacing at ``a``: within a binade
   it is the ulp, below the smallest normal it is the subnormal step.
2. ``t = a / q`` is exact (a power-of-two scaling) and the representable neighbours of ``a``
   are ``floor(t) * q`` and ``(floor(t) + 1) * q``; a carry into the next binade is representable.
3. nearest: ``rint(t)`` (ties to even); toward zero: ``floor(t)``; stochastic: ``floor(t) + 1``
   with probability ``t - floor(t)``, drawn from a counter-based hash of (seed, element index), so
   the result does not depend on threads or chunking.
4. A result above the largest finite value overflows. Nearest overflows only when it rounds past
   ``max`` (round first, then check, as OCP FP8 says: 464 -> 448 in e4m3fn, 465 -> NaN).
   Stochastic rounding has no unbiased answer past ``max`` and takes the nearest result there, so
   it never rounds a value <= max into a NaN code. Toward zero never overflows a finite value.
   The overflow value is ``+-max`` when saturating (and for formats without inf/NaN), else inf
   (ieee) or NaN (fn, fnuz).
5. NaN stays NaN; +-inf becomes ``+-max`` when saturating, else inf or NaN; formats without -0
   give +0; an unsigned format gives NaN for negative input; a format without zero gives NaN for 0.

Every input is rounded once, from its exact value: a float64 input straight from its own value (no
detour through float32); a Python int, Fraction or Decimal through a float64 stand-in that rounds
like the exact value (see ``exact_float64``); a float16/bfloat16 input into a result dtype that
holds every value of the format, so its result is never rounded a second time (see ``quantize``).
The compiled kernel (numba, optional) and the float64 route (``exact_float.py``, here over numpy,
also torch's and MXNet's) implement the same steps and are tested to agree bit for bit; 16-bit
inputs use a 65,536-entry table for nearest and toward-zero.
"""

from __future__ import annotations

import numbers
import os
from decimal import Decimal
from functools import lru_cache

import ml_dtypes
import numpy as np

from ..errors import PolyampError
from ..frameworks import ops_of
from . import exact_float, xp
from .exact_float import exact_float64
from .formats import FORMATS, FloatFormat, get_format
from .stream import MASK64, mix

ROUNDINGS = ("nearest", "stochastic", "toward_zero")
_MODE = {name: i for i, name in enumerate(ROUNDINGS)}
_ALIASES = {"nearest_even": "nearest", "rne": "nearest", "sr": "stochastic", "rtz": "toward_zero",
            "truncate": "toward_zero"}  # fmt: skip
INPUT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
                np.dtype(np.float64))  # fmt: skip


def quantize(x, fmt, rounding: str = "nearest", saturate: bool = False, seed: int | None = None):
    """Round every element of ``x`` to the nearest value of ``fmt`` per ``rounding``.

    Returns values exactly representable in ``fmt``. ``saturate`` clamps overflow to +-max instead
    of inf/NaN. ``seed`` makes stochastic rounding reproducible (None: fresh entropy).

    The result's dtype is ``x``'s (float32 or float64, which hold every format), except that a
    float16 or bfloat16 input comes back as float32 when its own dtype cannot hold every value of
    ``fmt`` (more mantissa bits, a larger max or finer subnormals: fp16 input to bf16, tf32, fp32 or
    e8m0fnu; bf16 input to fp16, tf32 or fp32). This is decided by the two formats, never by the
    data, and it is deliberate: casting back to the 16-bit dtype would round a second time
    (bf16 1e6 -> fp16 saturated is 65504, which bf16 would turn into 65536).
    Python numbers and lists become float64; a Python int, Fraction or Decimal is rounded from its
    exact value (2**60 + 2**36 + 1 -> fp32 is 2**60 + 2**37, not the tie float64 would make of it).

    >>> float(quantize(464.0, "e4m3fn")), float(quantize(465.0, "e4m3fn", saturate=True))
    (448.0, 448.0)
    >>> float(quantize(68.00000356923152, "e4m3fn"))  # float64 is rounded once
    72.0
    """
    ops = _framework_tensor(x)
    fmt, mode, saturate, seed = arguments(fmt, rounding, saturate, seed)
    if ops is not None:
        return ops.round_to_format(x, fmt, mode, saturate, seed)
    out = _quantize_array(_as_float_array(x), fmt, mode, saturate, seed or 0)
    return out[()] if out.ndim == 0 else out


def arguments(fmt, rounding, saturate, seed) -> tuple[FloatFormat, int, bool, int | None]:
    """``quantize``'s arguments checked (``PolyampError`` naming each bad one), for the core and every
    front end: the format, the rounding mode's code, the flag, and the seed (drawn when stochastic
    rounding gets None; validated even when unused, so a typo is not silently ignored)."""
    fmt = get_format(fmt)
    mode = _rounding(rounding)
    saturate = _flag(saturate, "saturate")
    if mode == _MODE["stochastic"]:
        seed = _seed(seed)
    elif seed is not None:
        _seed(seed)
    return fmt, mode, saturate, seed


def _framework_tensor(x):
    """The ops module of ``x``'s framework (``polyamp.frameworks.ops_of``), or None (numpy path)."""
    return ops_of(x)


def _quantize_array(arr: np.ndarray, fmt: FloatFormat, mode: int, saturate: bool, seed: int):
    if arr.dtype.itemsize == 2 and mode != _MODE["stochastic"]:
        return _table(arr.dtype, fmt, mode, saturate)[arr.view(np.uint16)]
    work = arr if arr.dtype.itemsize >= 4 else arr.astype(np.float32)
    flat = np.ascontiguousarray(work).reshape(-1)
    kernel = _kernel()
    if kernel is not None and fmt.signed and fmt.subnormals:
        out = np.empty_like(flat)
        kernel(flat, out, *_params(fmt, mode, saturate, seed))
    else:
        out = _quantize_numpy(flat, fmt, mode, saturate, seed)
    return out.reshape(arr.shape).astype(_result_dtype(arr.dtype, fmt), copy=False)


def _result_dtype(dtype: np.dtype, fmt: FloatFormat) -> np.dtype:
    """``dtype`` when it holds every value of ``fmt`` (float32 and float64 always do), else float32."""
    name = _result_name(dtype.name, fmt)
    return dtype if name == dtype.name else np.dtype(name)


def _result_name(name: str, fmt: FloatFormat) -> str:
    """:func:`_result_dtype` by dtype name (for front ends whose traced code must not touch numpy).

    A 16-bit dtype (an ieee format with subnormals) holds ``fmt`` when ``fmt`` has no more mantissa
    bits, no larger max and no finer spacing at the bottom of its range.
    """
    own = {"float16": FORMATS["fp16"], "bfloat16": FORMATS["bf16"]}.get(name)
    if own is None:
        return name
    holds = fmt.mbits <= own.mbits and fmt.max <= own.max and fmt.emin - fmt.mbits >= own.emin - own.mbits
    return name if holds else "float32"


@lru_cache(maxsize=64)
def _table(dtype: np.dtype, fmt: FloatFormat, mode: int, saturate: bool) -> np.ndarray:
    """All 65,536 results for a 16-bit input dtype, indexed by the input's bit pattern."""
    codes = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    with np.errstate(invalid="ignore"):
        values = _quantize_numpy(codes.astype(np.float64), fmt, mode, saturate, 0)
    return values.astype(_result_dtype(dtype, fmt))


def _params(fmt: FloatFormat, mode: int, saturate: bool, seed: int) -> tuple:
    """The scalars the kernel needs, in its argument order."""
    overflow = float(exact_float.overflow_value(fmt, saturate))
    return (fmt.mbits, fmt.emin, fmt.emax, float(fmt.max), overflow, mode, not fmt.has_negative_zero,
            np.uint64(mix(seed)))  # fmt: skip


def _quantize_numpy(flat: np.ndarray, fmt: FloatFormat, mode: int, saturate: bool, seed: int) -> np.ndarray:
    """The reference implementation of the module docstring: ``exact_float.round_float64`` over numpy."""
    with np.errstate(invalid="ignore", over="ignore"):
        r = exact_float.round_float64(xp, flat.astype(np.float64), fmt, mode, saturate, seed)
    return r.astype(flat.dtype)


@lru_cache(maxsize=1)
def _kernel():
    """The numba kernel, or None when numba is absent or POLYAMP_NO_NUMBA is set."""
    if os.environ.get("POLYAMP_NO_NUMBA"):
        return None
    try:
        from ._kernel import quantize_kernel
    except ImportError:
        return None
    return quantize_kernel


@lru_cache(maxsize=1)
def uniform_grid_kernel():
    """The compiled stream of ``stream.uniform53`` over a 2-D grid of flat indices (``_kernel.uniform_grid``),
    or None as for ``_kernel``: the torch front end's stochastic rounding on the CPU takes it."""
    if _kernel() is None:
        return None
    from ._kernel import uniform_grid

    return uniform_grid


def stochastic_tiles_kernel():
    """The compiled single pass of NVFP4's stochastically rounded elements over a 2-D plane of tiles
    (``_kernel.stochastic_tiles``), or None as for ``_kernel``: torch's NVFP4 on the CPU takes it."""
    if _kernel() is None:
        return None
    from ._kernel import stochastic_tiles

    return stochastic_tiles


def backend() -> str:
    """Which implementation ``quantize`` uses for 32/64-bit input: 'numba' or 'numpy'."""
    return "numba" if _kernel() is not None else "numpy"


# -- argument checking ----------------------------------------------------------------------------
def _rounding(rounding) -> int:
    key = rounding.lower().replace("-", "_") if isinstance(rounding, str) else None
    key = _ALIASES.get(key, key)
    if key not in _MODE:
        raise PolyampError(f"unknown rounding {rounding!r}; accepted: {', '.join(ROUNDINGS)}")
    return _MODE[key]


def _flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise PolyampError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _seed(seed) -> int:
    if seed is None:
        return int(np.random.SeedSequence().entropy) & MASK64
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise PolyampError(f"seed must be an integer in [0, 2^64) or None, got {seed!r}")
    if not 0 <= int(seed) <= MASK64:
        raise PolyampError(f"seed must be an integer in [0, 2^64) or None, got {seed!r}")
    return int(seed)


def _as_float_array(x) -> np.ndarray:
    """``x`` as a native-order float16/bfloat16/float32/float64 array holding its exact values."""
    if isinstance(x, (bool, np.bool_)):
        raise PolyampError(f"expected a floating-point array, got {x!r}")
    if _is_number(x) and not isinstance(x, np.generic):
        return np.asarray(exact_float64(x), dtype=np.float64)
    if type(x).__module__.split(".")[0] in ("torch", "tensorflow", "jax", "jaxlib", "mxnet"):
        raise PolyampError(
            f"quantize takes numpy arrays, torch/TF/JAX/MXNet tensors, got a {type(x).__module__}."
            f"{type(x).__name__} (no kernel for it yet); convert it with np.asarray (or .numpy()) first"
        )
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError, OverflowError) as err:
        raise PolyampError(
            f"cannot read {_brief(x)} as an array ({err}); accepted: a numpy array, a number, "
            "or a rectangular (not ragged) nested list of numbers"
        ) from None
    if not isinstance(x, np.ndarray):  # a (nested) list of Python numbers, not an integer tensor
        if arr.dtype.kind in "iu":
            arr = _ints_as_float64(arr)
        elif arr.dtype == object and all(_is_number(v) for v in arr.flat):  # huge ints, Fractions, ...
            arr = np.array([exact_float64(v) for v in arr.flat], np.float64).reshape(arr.shape)
    if arr.dtype.kind == "f" and not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype not in INPUT_DTYPES:
        what = "an object array (ragged, or not all numbers)" if arr.dtype == object else f"dtype {arr.dtype}"
        raise PolyampError(
            f"expected a floating-point array, got {what}; accepted: "
            + ", ".join(str(d) for d in INPUT_DTYPES)
            + ", or (lists of) Python numbers"
        )
    return arr


def _is_number(v) -> bool:
    """A real Python or numpy number (int, float, Fraction, Decimal), not a bool."""
    real = isinstance(v, (numbers.Rational, float, Decimal, np.floating))
    return real and not isinstance(v, (bool, np.bool_))


def _ints_as_float64(arr: np.ndarray) -> np.ndarray:
    out = arr.astype(np.float64)
    big = np.abs(out) > 2.0**53  # where float64 may have rounded the int
    if big.any():
        out[big] = [exact_float64(int(v)) for v in arr[big]]
    return out


def _brief(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
