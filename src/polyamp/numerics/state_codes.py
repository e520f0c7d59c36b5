"""Optimizer state stored low: bfloat16, fp8 (e4m3fn, a scale per block) and 8-bit block-wise codes.

Each form stores a float32 moment ``m`` (any shape) as a dict of arrays and returns it as float32:

``bf16``   ``m`` rounded to bfloat16 (nearest-even), 2 bytes per value.
``fp8``    ``m`` in blocks of ``BLOCK`` values of the flattened tensor; per block ``s = amax / 448``
           (float32) and the values ``m / s`` rounded to e4m3fn (nearest-even), 1 byte per value plus
           4 bytes per block. A block of zeros has ``s = 1``. (torchao's ``OptimStateFp8``.)
``int8``   the block-wise dynamic quantization of bitsandbytes' 8-bit optimizers (Dettmers et al.,
           "8-bit Optimizers via Block-wise Quantization", 2022): per block its ``amax``; each value
           ``m / amax`` becomes the index of the nearest entry of a 256-entry table (``dynamic_map``;
           ties to the lower entry), 1 byte per value plus 4 bytes per block. Moments that are never
           negative (second moments) take the unsigned table, as torchao's ``AdamW8bit`` does.

The algorithm is written once over a front end's ops (``ops.reshape``, ``pad_end``, ``amax``, ``abs``,
``where``, ``clip``, ``high16``, ``take``, ``cast``); numpy's are ``numerics.xp``'s.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ..errors import invalid

BLOCK = 256
"""Values per block of the fp8 and int8 forms (bitsandbytes >= 0.44 and torchao use 256)."""

FORMS = ("fp32", "bf16", "fp8", "int8")
_FP8_MAX = 448.0


@functools.lru_cache(maxsize=2)
def dynamic_map(signed: bool = True) -> np.ndarray:
    """The 256 sorted float32 values of bitsandbytes' dynamic data type (``create_dynamic_map`` with 7
    exponent bits, 8 bits in all): for ``i = 0 .. 6`` the midpoints of ``2^i + 1`` (signed) or
    ``2^(i+1) + 1`` (unsigned) points evenly spaced in [0.1, 1], times ``10^(i - 6)``, their negatives
    when signed, and 0 and 1."""
    values = [0.0, 1.0]
    for i in range(7):
        edges = np.linspace(0.1, 1.0, (2**i if signed else 2 ** (i + 1)) + 1)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
        values += list(mids) + (list(-mids) if signed else [])
    table = np.sort(np.asarray(values, dtype=np.float32))
    assert table.size == 256
    return table


def check_form(form: object) -> str:
    """``form`` if it is one of ``FORMS`` (case-insensitive), else a PolyampError."""
    key = form.strip().lower() if isinstance(form, str) else None
    if key not in FORMS:
        raise invalid("optimizer-state form", form, FORMS)
    return key


def nbytes(form: str, size: int) -> int:
    """Bytes a moment of ``size`` values takes in ``form``."""
    blocks = -(-size // BLOCK)
    return {"fp32": 4 * size, "bf16": 2 * size, "fp8": size + 4 * blocks, "int8": size + 4 * blocks}[form]


def _blocks(ops, m32):
    """``m32`` flattened, zero padded to whole blocks, shape ``(blocks, BLOCK)``."""
    n = ops.size(m32)
    flat = ops.reshape(m32, (n,))
    pad = -n % BLOCK
    flat = ops.pad_end(flat, (pad,)) if pad else flat
    return ops.reshape(flat, (max(1, (n + pad) // BLOCK), BLOCK)) if n else ops.reshape(flat, (0, BLOCK))


def encode(ops, m32, form: str, signed: bool = True) -> dict:
    """float32 ``m32`` stored in ``form`` (see the module docstring): a dict of arrays."""
    if form == "fp32":
        return {"values": m32}
    if form == "bf16":
        return {"values": ops.cast(m32, "bfloat16")}
    b = _blocks(ops, m32)
    amax = ops.amax(ops.abs(b), (1,))
    amax = ops.reshape(amax, (-1, 1))
    if form == "fp8":
        scale = ops.where(amax > 0, amax / _FP8_MAX, ops.const(1.0, amax))
        codes = ops.clip(b / scale, -_FP8_MAX, _FP8_MAX)  # amax / (amax / 448) may round past 448
        return {"codes": _flat(ops, ops.cast(codes, "float8_e4m3fn"), ops.size(m32)), "scale": scale}
    safe = ops.where(amax > 0, amax, ops.const(1.0, amax))
    v = b / safe
    base, mid = _nearest_lookup(signed)
    key = ops.high16(v)
    codes = ops.cast(ops.take(base, key) + ops.cast(v > ops.take(mid, key), "int32"), "uint8")
    return {"codes": _flat(ops, codes, ops.size(m32)), "scale": amax}


@functools.lru_cache(maxsize=2)
def _nearest_lookup(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The nearest table entry of a float32 ``v`` in two look-ups by its top 16 bits ``k`` (sign, exponent,
    7 fraction bits): ``base[k] + (v > mid[k])`` is the number of midpoints below ``v`` (ties go to the
    lower entry). The values sharing ``k`` span one bfloat16 ulp (2^-8 relative at most), and adjacent
    midpoints are further apart than that (0.7 % relative at least: the unsigned table near 1), so at most
    one midpoint ``mid[k]`` lies in that span and ``base[k]`` counts those below it
    (``test_int8_codes_are_the_nearest_table_entry_of_each_block`` checks every midpoint and its
    neighbours)."""
    table = dynamic_map(signed)
    mids = ((table[:-1] + table[1:]) / np.float32(2)).astype(np.float32)
    k = np.arange(1 << 16, dtype=np.uint32)
    t = (k << 16).view(np.float32)  # the span's end nearest zero
    far = ((k << 16) | 0xFFFF).view(np.float32)  # the span's end farthest from zero
    lo = np.where(t >= 0, t, far)  # the smallest value of the span: t (>= 0) or far (< 0)
    with np.errstate(invalid="ignore"):
        base = np.searchsorted(mids, lo, side="left").astype(np.int32)
    mid = np.append(mids, np.float32(np.inf))[np.minimum(base, mids.size)]
    return base, mid.astype(np.float32)


def _flat(ops, codes, n: int):
    """The codes of the ``n`` values, without the last block's padding."""
    return ops.reshape(codes, (-1,))[:n]


def decode(ops, stored: dict, form: str, shape: tuple[int, ...], signed: bool = True):
    """The float32 moment of shape ``shape`` that ``encode`` stored."""
    if form in ("fp32", "bf16"):
        return ops.cast(stored["values"], "float32")
    codes = stored["codes"]
    v = ops.cast(codes, "float32") if form == "fp8" else ops.take(dynamic_map(signed), codes)
    n = ops.size(codes)
    b = _blocks(ops, v) * stored["scale"]
    return ops.reshape(ops.reshape(b, (-1,))[:n], shape)


@functools.lru_cache(maxsize=1)
def compiled():
    """The compiled kernels (``_state_kernel``: stochastic bfloat16 rounding, the 8-bit form) for CPU
    arrays, or None when numba is absent or POLYAMP_NO_NUMBA is set."""
    if os.environ.get("POLYAMP_NO_NUMBA"):
        return None
    try:
        from . import _state_kernel
    except ImportError:
        return None
    return _state_kernel


def encode_int8_compiled(m32: np.ndarray, signed: bool) -> dict:
    """``encode(xp, m32, "int8", signed)`` by the compiled kernel (a float32 numpy array; same arrays)."""
    flat = np.ascontiguousarray(m32, np.float32).reshape(-1)
    codes = np.empty(flat.size, np.uint8)
    scale = np.empty((max(1, -(-flat.size // BLOCK)) if flat.size else 0, 1), np.float32)
    base, mid = _nearest_lookup(signed)
    compiled().encode_int8(flat, codes, scale.reshape(-1), base, mid, BLOCK)
    return {"codes": codes, "scale": scale}


def decode_int8_compiled(codes: np.ndarray, scale: np.ndarray, signed: bool) -> np.ndarray:
    """``decode``'s flat float32 values of the 8-bit form by the compiled kernel."""
    out = np.empty(codes.size, np.float32)
    compiled().decode_int8(codes.reshape(-1), scale.reshape(-1), dynamic_map(signed), out, BLOCK)
    return out
