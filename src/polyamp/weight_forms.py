"""Weight-only inference forms: a trained weight stored low, dequantized where it is used.

Each form stores a float32 weight ``w`` (2-D or more; ``axis`` is the input axis its dot product sums
over, the other axes are output channels) as a dict of numpy arrays, encoded once (``encode``, in numpy),
and decoded in a front end's ops at every use (``decode``, written once over ``ops.cast``, ``take``,
``reshape``, ``pad_end``, ``unpack4``, ``moveaxis``):

========  ==========================================================================  ================
form      stored                                                                      bytes per value
========  ==========================================================================  ================
bf16      ``w`` rounded to bfloat16 (nearest-even)                                     2
fp16      ``w`` rounded to float16 (nearest-even, saturating at 65504)                 2
int8      per output channel ``s = amax / 127``; ``rint(w / s)`` in [-127, 127] (int8)   1 + 4 per channel
fp8       per output channel ``s = amax / 448``; ``w / s`` to e4m3fn (nearest-even)     1 + 4 per channel
nvfp4     ``polyamp.encode_blocks(w, "nvfp4")`` along ``axis`` (16 values per e4m3      1/2 + 1/16
          scale, one float32 global scale); two e2m1 codes per byte
mxfp4     ``encode_blocks(w, "mxfp4")`` (32 values per e8m0 scale)                      1/2 + 1/32
========  ==========================================================================  ================

A channel of zeros has ``s = 1``. The 4-bit forms decode to exactly ``polyamp.quantize_blocks(w, form)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .errors import PolyampError, invalid
from .numerics import decode as decode_codes
from .numerics import encode_blocks

FORMS = ("bf16", "fp16", "int8", "fp8", "nvfp4", "mxfp4")
_SCALE_FORMAT = {"nvfp4": "e4m3fn", "mxfp4": "e8m0fnu"}


@dataclass
class WeightOnlyRecord:
    """What a front end's ``quantize_weights`` did: layer (or tree path) -> form, layer -> why it was kept,
    and the weights' bytes before and after."""

    form: str
    quantized: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0


def check_form(form: object) -> str:
    key = form.strip().lower() if isinstance(form, str) else None
    if key not in FORMS:
        raise invalid("weight-only form", form, FORMS)
    return key


@functools.lru_cache(maxsize=4)
def _table(fmt: str) -> np.ndarray:
    """float32 values of every code of ``fmt`` (16 for e2m1fn, 256 for the 8-bit formats)."""
    n = 16 if fmt == "e2m1fn" else 256
    return decode_codes(np.arange(n, dtype=np.uint8), fmt).astype(np.float32)


def encode(w: np.ndarray, form: str, axis: int = -1) -> dict:
    """float32 ``w`` in ``form`` along the input axis ``axis``: a dict of numpy arrays."""
    w = np.asarray(w, np.float32)
    if w.ndim < 2:
        raise PolyampError(f"weight-only forms take weights of 2 or more axes, got shape {w.shape}")
    axis = axis % w.ndim
    if form in ("bf16", "fp16"):
        dtype = ml_dtypes.bfloat16 if form == "bf16" else np.float16
        v = w if form == "bf16" else np.clip(w, -65504, 65504)
        return {"values": v.astype(dtype)}
    if form in ("int8", "fp8"):
        amax = np.abs(w).max(axis=axis, keepdims=True)
        top = np.float32(127 if form == "int8" else 448)
        s = np.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)
        q = np.clip(w / s, -top, top)
        if form == "int8":
            return {"codes": np.rint(q).astype(np.int8), "scale": s}
        codes = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        return {"codes": codes, "scale": s}
    moved = np.moveaxis(w, axis, -1)
    blocks = encode_blocks(moved, form, axis=-1)
    e = blocks.elements
    if e.shape[-1] % 2:
        e = np.concatenate([e, np.zeros((*e.shape[:-1], 1), np.uint8)], axis=-1)
    packed = (e[..., 0::2] | (e[..., 1::2] << 4)).astype(np.uint8)
    out = {"codes": packed, "scales": np.asarray(blocks.scales, np.uint8)}
    if blocks.global_scale is not None:
        out["global"] = np.asarray(np.float32(blocks.global_scale))
    return out


def decode(ops, stored: dict, form: str, shape: tuple[int, ...], axis: int = -1):
    """The float32 weight of shape ``shape`` that ``encode`` stored, as ``ops``' array."""
    axis = axis % len(shape)
    if form in ("bf16", "fp16"):
        return ops.cast(stored["values"], "float32")
    if form == "int8":
        return ops.cast(stored["codes"], "float32") * stored["scale"]
    if form == "fp8":
        return ops.take(_table("e4m3fn"), stored["codes"]) * stored["scale"]
    moved = tuple(shape[:axis]) + tuple(shape[axis + 1:]) + (shape[axis],)
    n = moved[-1]
    elements = ops.take(_table("e2m1fn"), ops.unpack4(stored["codes"]))
    scales = ops.take(_table(_SCALE_FORMAT[form]), stored["scales"])
    block = 16 if form == "nvfp4" else 32
    nb = scales.shape[-1]
    padded = nb * block
    if elements.shape[-1] < padded:
        elements = ops.pad_end(elements, (0,) * (len(moved) - 1) + (padded - elements.shape[-1],))
    # element x scale is exact in float32 (2 + 3 significant bits); x global is then one rounding, as in
    # the core's float64 product
    blocked = ops.reshape(elements[..., :padded], (*moved[:-1], nb, block))
    values = blocked * ops.reshape(scales, (*moved[:-1], nb, 1))
    values = ops.reshape(values, (*moved[:-1], padded))[..., :n]
    values = values * stored["global"] if "global" in stored else values
    return ops.moveaxis(values, -1, axis)


def nbytes(stored: dict) -> int:
    """Bytes the stored arrays take."""
    return sum(int(a.nbytes) for a in stored.values())
