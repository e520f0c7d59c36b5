"""torch's array primitives: the ops layer polyamp's framework-neutral algorithms run over.

Only torch's vocabulary lives here (as in Keras 3's ``keras/src/backend/<name>/``): each algorithm
(exact rounding and block formats, the doctor's binning, Hadamard tiles, the recipes' GEMM rule) is
written once in the core over the functions of a module like this one. ``polyamp.frameworks.ops_of``
finds this module from a torch.Tensor.
"""

from __future__ import annotations

import sys

import torch

from ..errors import PolyampError
from ..numerics import exact_float

NAME = "torch"


def accepts(x) -> bool:
    """Whether ``x`` is an array of this framework the core's algorithms take."""
    return isinstance(x, torch.Tensor)


def round_to_format(x, fmt, mode, saturate, seed):
    """``polyamp.quantize`` on a torch tensor, its arguments checked by the core (``fmt`` a FloatFormat,
    ``mode`` the rounding's code, ``seed`` an int or None): the float64 route, on ``x``'s device; the result
    never requires grad."""
    from ..numerics.rounding import _result_name

    x = _tensor(x, "quantize")
    out = round_float64(x.to(torch.float64), fmt, mode, saturate, seed or 0)
    return out.to(_TORCH[_result_name(_NAMES[x.dtype], fmt)])


def round_to_blocks(x, bf, axes, shape, rule, mode, seed):
    """``polyamp.quantize_blocks`` on a torch tensor, its arguments checked by the core (``bf`` a
    BlockFormat, ``axes`` / ``shape`` the blocked axes and block shape, ``rule`` the scale rule or None):
    whole blocks no wider than float32 take ``block_plane``'s measured fast path, else the float64 route."""
    from . import block_plane

    x = _tensor(x, "quantize_blocks")
    wide = x.dtype == torch.float64
    ops = sys.modules[__name__]
    fast = None if wide else block_plane.fast_blocks(ops, x, bf, axes, shape, rule, mode, seed or 0)
    if fast is not None:
        return fast
    x64 = x.to(torch.float64)
    elements, scales, g = exact_float.encode_blocks(ops, x64, bf, axes, shape, rule, mode, seed or 0, wide)
    values = exact_float.block_values(ops, axes, shape, elements, scales, g)
    return values.to(x64.dtype if wide else torch.float32)


# -- rounding and block formats ------------------------------------------------------------------------
# the primitives of ``polyamp.numerics.exact_float`` (the float64 route); words are int64 (wrapping)
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
          torch.float64: "float64"}  # fmt: skip
_TORCH = {v: k for k, v in _NAMES.items()}
_FLOAT8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_CHUNK = 1 << 16


def _tensor(x, name: str) -> torch.Tensor:
    if x.dtype not in _NAMES:
        raise PolyampError(
            f"expected a floating-point tensor, got dtype {x.dtype}; accepted: torch.float16, "
            "torch.bfloat16, torch.float32, torch.float64"
        )
    return x.detach()


def round_float64(v: torch.Tensor, fmt, mode: int, saturate: bool, seed: int) -> torch.Tensor:
    """``exact_float.round_float64`` of float64 ``v``. Eager on CPU, in chunks of ``_CHUNK`` elements, so
    that the temporaries stay small and warm (one pass over 16M float64 elements otherwise spends most of
    its time faulting in fresh pages), nearest and toward zero in place (``_round_in_place``); compiled or
    on an accelerator, the shared expression."""
    ops = sys.modules[__name__]
    if v.device.type != "cpu" or torch.compiler.is_compiling():
        return exact_float.round_float64(ops, v, fmt, mode, saturate, seed)
    flat = v.reshape(-1)
    out = torch.empty_like(flat)
    for i in range(0, v.numel(), _CHUNK):
        chunk = flat[i : i + _CHUNK]
        if mode == exact_float.STOCHASTIC:
            out[i : i + _CHUNK] = exact_float.round_float64(ops, chunk, fmt, mode, saturate, seed, i)
        else:
            out[i : i + _CHUNK] = _round_in_place(chunk, fmt, mode, saturate)
    return out.view(v.shape)


def _round_in_place(v: torch.Tensor, fmt, mode: int, saturate: bool) -> torch.Tensor:
    """``exact_float.round_float64`` to nearest or toward zero on an eager CPU chunk, in place on
    its temporaries: the same steps, measured 2x faster than the out-of-place ops on 4096 x 4096
    (``benchmarks/quantize_torch.py``)."""
    overflow, maxval = exact_float.overflow_value(fmt, saturate), float(fmt.max)
    a = v.abs()
    t, q = spacing(a, fmt.emin, fmt.emax + 1, fmt.mbits)
    if mode == exact_float.NEAREST:
        r = t.round_().mul_(q)  # half to even
        r.masked_fill_(r > maxval, overflow)
    else:
        r = t.floor_().mul_(q).clamp_(max=maxval)
    if overflow != fmt.max:
        r.masked_fill_(a == torch.inf, overflow)
    r.masked_fill_(torch.isnan(a), torch.nan).copysign_(v)
    if not fmt.has_negative_zero:
        r.add_(0.0)  # -0 + 0 is +0
    if not fmt.signed:
        r.masked_fill_(v < 0, torch.nan)
    if not fmt.subnormals:
        r = torch.where(a == 0, torch.nan, torch.where((a > 0) & (r == 0), fmt.min_normal, r))
    return r


def round_saturated(v, fmt, mode: int, seed: int, narrow: bool):
    """``round_float64`` saturating, or an exact shortcut: nearest onto e2m1fn by its three spacings
    (``round(|v| / step) * step``, ties to even at the grid's own parity, clamped to 6), or torch's own
    float8 cast (ties to even, after clamping to +-max) onto e4m3fn / e5m2 of ``narrow`` values (``x`` no
    wider than float32 times a power of two: float32 holds them, or they are far below half the element's
    smallest subnormal, 0 either way, sign kept)."""
    if mode == 0 and fmt.name == "e2m1fn":
        a = v.abs()
        step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
        return a.div_(step).round_().mul_(step).clamp_(max=6.0).copysign_(v)
    if mode != 0 or fmt.name not in _FLOAT8 or not narrow:
        return round_float64(v, fmt, mode, True, seed)
    fmax = float(fmt.max)
    return v.float().clamp_(-fmax, fmax).to(_FLOAT8[fmt.name]).double()


def const(value: float, like):
    return value


def size(v) -> int:
    return v.numel()


def abs(v):  # noqa: A001 - the ops vocabulary
    return v.abs()


def spacing(a, lo: int, hi: int, mbits: int):
    """``(t, q)``: ``q = 2^(e - mbits)``, ``e = floor(log2 a)`` clamped to ``[lo, hi]``, from the exponent
    field; ``t = a * (1 / q)``, exact, ``1 / q`` from exponent bits too."""
    e = (a.view(torch.int64) >> 52).clamp_(lo + 1023, hi + 1023)
    t = torch.sub(2046 + mbits, e).bitwise_left_shift_(52).view(torch.float64).mul_(a)
    return t, e.sub_(mbits).bitwise_left_shift_(52).view(torch.float64)


def rint(t):
    return torch.round(t)  # half to even


def floor(t):
    return torch.floor(t)


def minimum(a, b):
    return a.clamp(max=b) if isinstance(b, float) else torch.minimum(a, b)


def maximum(a, b):
    return a.clamp(min=b) if isinstance(b, float) else torch.maximum(a, b)


def where(cond, a, b):
    return torch.where(cond, a, b)


def isnan(v):
    return torch.isnan(v)


def isinf(v):
    return torch.isinf(v)


def isfinite(v):
    return torch.isfinite(v)


def keep_nan(r, a):
    """``r`` with the canonical NaN where ``a`` is NaN."""
    return r.masked_fill(torch.isnan(a), torch.nan)


def copysign(r, v):
    return torch.copysign(r, v)


def float64(v):
    return v.to(torch.float64)


def integer(flags):
    return flags.to(torch.int64)


def clip(v, lo, hi):
    return v.clamp(lo, hi)


def exponent(a):
    """floor(log2 a) of normal ``a`` from its exponent field (-1023 for 0 and subnormals), int64."""
    return (a.view(torch.int64) >> 52) - 1023


def pow2(k):
    """2^k in float64 from exponent bits, for integer ``k`` in [-1022, 1023]."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def may_hold(flags) -> bool:
    """True without looking: a data-dependent branch would sync and break ``torch.compile``."""
    return True


def finite_max(a):
    finite = torch.where(torch.isfinite(a), a, 0.0)
    return finite.amax() if a.numel() else finite.new_zeros(())


def item(v) -> float:
    return float(v.item())


def float32_round(v):
    return v.to(torch.float32).to(torch.float64)


def float32(v):
    return v.to(torch.float32)


def moveaxis(v, src, dst):
    return torch.movedim(v, src, dst)


def pad_end(v, widths):
    return torch.nn.functional.pad(v, [p for w in reversed(widths) for p in (0, w)])


def reshape(v, shape):
    return v.reshape(shape)


def amax(v, axes):
    return v.amax(dim=axes) if v.numel() else v.sum(dim=axes)


def repeat(v, b: int, axis: int, length: int):
    return v.index_select(axis, torch.arange(length, device=v.device) // b)


def words(start: int, stop: int, like):
    return torch.arange(start, stop, dtype=torch.int64, device=like.device)


def word(c: int, like) -> int:
    """A 64-bit constant as int64 (two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def xor(a, b):
    return torch.bitwise_xor(a, b)


def shr(z, s: int):
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def unit53(z):
    return shr(z, 11).to(torch.float64) * 2.0**-53


# -- optimizer state codes (``numerics.state_codes``) -------------------------------------------------
def cast(v, dtype: str):
    return v.to(getattr(torch, dtype))


def take(table, codes):
    """``table[codes]``: the numpy ``table``'s entries at integer ``codes``."""
    return torch.from_numpy(table).to(codes.device)[codes.long()]


def unpack4(codes):
    """Two 4-bit codes per byte (low nibble first) -> one code per uint8, the last axis doubled."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1)


def high16(v):
    """The top 16 bits of float32 ``v`` (sign, exponent, 7 fraction bits) as integers."""
    return (v.float().contiguous().view(torch.int32) >> 16) & 0xFFFF


# -- binning (the doctor) ------------------------------------------------------------------------------
# the measured block formats (``doctor.blocks.measure_on``)
def measured(t):
    """``t``'s values as float32, at least one axis (no grad)."""
    x = t.detach()
    x = x if x.dtype == torch.float32 else x.float()
    return x.reshape(x.shape if x.ndim else (1,))


def numel(x) -> int:
    return x.numel()


def zero_pad_end(x, widths):
    """``x`` zero padded at the end of each axis by ``widths``."""
    return torch.nn.functional.pad(x, [p for w in reversed(widths) for p in (0, w)])


def block_amax(x, tiles):
    """Per block (``doctor.blocks.blocked``): the finite amax and whether it holds inf/NaN, as numpy."""
    import numpy as np

    from ..doctor.blocks import blocked
    from . import xp

    xb, dims = blocked(xp, x, tiles)
    ab = xb.abs()
    amax = ab.amax(dims, keepdim=True).cpu().numpy()  # NaN and inf propagate: a block to look at
    if np.isfinite(amax).all():
        return amax, np.zeros(amax.shape, bool)
    finite = torch.isfinite(ab)
    amax = torch.where(finite, ab, 0.0).amax(dims, keepdim=True)
    return amax.cpu().numpy(), ((~finite).sum(dims, keepdim=True) > 0).cpu().numpy()


def measure_cast(x, cast, block, scale):
    """``x`` cast by ``polyamp.torch.quantize`` as ``cast`` says (tensorwise at ``scale``), float32."""
    from ..numerics import quantize, quantize_blocks

    if cast.scaling == "tensorwise":
        s = torch.tensor(scale, dtype=torch.float32, device=x.device)
        return quantize(x * s, cast.format, rounding=cast.rounding, saturate=True, seed=cast.seed).float() / s
    axis = (-2, -1) if len(block) == 2 else -1
    return quantize_blocks(x, cast.format, axis=axis, block=block, scale_rule=cast.scale_rule,
                           rounding=cast.rounding, seed=cast.seed)  # fmt: skip


def block_stats(x, q, thr, tiles, block_scaling: bool, spoiled: bool):
    """(nonfinite, nonzero, underflow, clipped, spoiled) counts and (sum (q - x)^2, sum x^2) in float64
    (``doctor.blocks.measure``) of ``x`` and its cast ``q``, ``thr`` the blocks' clip thresholds."""
    from ..doctor.blocks import blocked
    from . import xp

    xb, dims = blocked(xp, x, tiles)
    qb, _ = blocked(xp, q, tiles)
    ab, thr_t = xb.abs(), torch.from_numpy(thr).to(x.device)
    if not spoiled:  # all finite: a zero x casts to zero; underflow = zeros of q - zeros of x (padding too)
        zx, zq, clip = torch.stack([(xb == 0).sum(), (qb == 0).sum(), (ab > thr_t).sum()]).tolist()
        x64 = x.reshape(-1).double()
        d = q.reshape(-1).double().sub_(x64)
        return (0, xb.numel() - zx, zq - zx, clip, 0), (float(d.dot(d)), float(x64.dot(x64)))
    finite = torch.isfinite(ab)
    bad = (~finite).sum(dims, keepdim=True) > 0
    good = finite & ~bad if block_scaling else finite  # tensorwise: no block turns NaN
    nonzero = finite & (ab != 0)
    ok = nonzero & good
    d = torch.where(good, qb.double() - xb.double(), 0.0)
    e = torch.where(good, ab, 0.0).double()
    counts = torch.stack([(~finite).sum(), nonzero.sum(), (ok & (qb == 0)).sum(), (ok & (ab > thr_t)).sum(),
                          (nonzero & ~good).sum()]).tolist()  # fmt: skip
    return counts, (float((d * d).sum()), float((e * e).sum()))


def float_bits(x):
    """The bits of the float tensor ``x`` as the int of its width (a view)."""
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int64)


def int_float(a):
    """The int tensor ``a`` converted to the float of its width."""
    return a.float() if a.dtype == torch.int32 else a.double()


def select(c, x, y):
    return torch.where(c, x, y)


def shift_right(x, n: int):
    return x >> n


def bit_and(x, m: int):
    return x & m


def clamp_int(x, lo: int, hi: int):
    return x.clamp(lo, hi)


# -- Hadamard tiles and the recipes' GEMM rule ---------------------------------------------------------
_CONSTANTS: dict = {}  # the core's numpy constants, copied to each device once


def tensor_facts(x) -> tuple[str, tuple]:
    """``x``'s dtype name (numpy's spelling) and static shape."""
    return str(x.dtype).removeprefix("torch."), tuple(x.shape)


def float32_tiles(x, axis: int, tile: int):
    """``x`` as a new float32 tensor (no grad), ``axis`` zero padded at its end to a multiple of ``tile``
    and split in place into ``[tiles, tile]``."""
    n, lead, rest = x.shape[axis], x.shape[:axis], x.shape[axis + 1 :]
    t = torch.zeros(*lead, -(-n // tile) * tile, *rest, dtype=torch.float32, device=x.device)
    t.narrow(axis, 0, n).copy_(x.detach())
    return t.view(*lead, -(-n // tile), tile, *rest)


def times(t, c):
    """``t * c``, ``c`` a numpy float32 constant broadcast against ``t`` (``t`` is overwritten)."""
    if not c.ndim:
        return t.mul_(float(c))
    key = (c.tobytes(), c.shape, t.device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.from_numpy(c.copy()).to(t.device)
    return t.mul_(_CONSTANTS[key])


def butterfly(t, axis: int, h: int):
    """In each group of ``2h`` along ``axis`` (of ``t``), the first ``h`` (``a``) and the next ``h`` (``b``)
    become ``a + b`` and ``a - b``, into a new tensor."""
    pairs = (*t.shape[:axis], t.shape[axis] // (2 * h), 2, h, *t.shape[axis + 1 :])
    u = torch.empty_like(t)
    a, b = t.view(pairs).unbind(axis + 1)
    s, d = u.view(pairs).unbind(axis + 1)
    torch.add(a, b, out=s)
    torch.sub(a, b, out=d)
    return u


def merge_tiles(t, axis: int):
    """``t`` with ``axis`` and ``axis + 1`` merged into one."""
    return t.view(*t.shape[:axis], t.shape[axis] * t.shape[axis + 1], *t.shape[axis + 2 :])
