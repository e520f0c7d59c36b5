"""``quantize`` and ``quantize_blocks`` on PyTorch tensors, in PyTorch ops, bit-identical to the core.

``polyamp.quantize`` / ``polyamp.quantize_blocks`` call these for a torch tensor; they take and give
the same arguments and values as ``polyamp.numerics.rounding`` / ``blocks`` (read those docstrings
for the rules), on any device, with no host round trip.

Scalar rounding, elementwise in float64 (every float16/bfloat16/float32 value converts exactly, and
float64 input is rounded from its own value), as the core's compiled kernel does it:

1. ``e`` = the biased float64 exponent field of ``a = |x|``, clamped to the format's
   ``[emin, emax + 1]``; the spacing ``q = 2^(e - 1023 - mbits)`` and ``1/q`` are built from
   exponent bits, so ``t = a / q`` is an exact multiply;
2. nearest: ``round(t)`` (ties to even); toward zero: ``floor(t)``; stochastic: ``floor(t) + 1`` when
   ``u < t - floor(t)``, with ``u`` the core's splitmix64 stream of (seed, flat element index) in
   int64 arithmetic (wrapping multiplies; logical shifts are arithmetic shifts then a mask), so
   the same seed gives the same bits as numpy;
3. overflow, inf, NaN, the sign, -0 and the unsigned / zero-less formats as the core's
   ``_quantize_numpy``; the result dtype is the core's (``_result_name``).

Block formats follow ``blocks.py`` step for step in float64 tensors: block amax (zero padded, NaN
wins), the MX scale exponent from exponent bits (the rules compared on ``k`` clamped to [-128, 127],
where the final clamp to [-127, 127] already decides the rest), NVFP4's float32 global scale (float64
quotient then float32: for a float32 amax that quotient never sits on a float32 midpoint, so it rounds
as the exact one; float64 input uses the core's exact host computation, one ``.item()``), the
element rounding above indexed by position in ``x``, then ``element * scale (* global)`` rounded once
to the result dtype. No Python branch depends on the data (except that ``.item()``): both compile
with ``torch.compile(fullgraph=True)`` (TorchScript cannot trace them: it has no ``view(dtype)``).
The result never requires grad. float64 is needed on the device (MPS has none).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PolyampError
from ..numerics import blocks as _blocks
from ..numerics.formats import FloatFormat, get_format
from ..numerics.rounding import _MODE, _flag, _mix, _result_name, _rounding, _seed

# by name: torch.compile (2.11) cannot trace a dict keyed by numpy dtypes
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
          torch.float64: "float64"}  # fmt: skip
_TORCH = {v: k for k, v in _NAMES.items()}
_U64 = 1 << 64
# splitmix64's constants as int64 (two's complement)
_GOLDEN, _M1, _M2 = (c - _U64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_CHUNK = 1 << 16


def accepts(x) -> bool:
    """Whether ``x`` is a tensor this module quantizes (the core's dispatch asks)."""
    return isinstance(x, torch.Tensor)


def quantize(x: torch.Tensor, fmt, rounding: str = "nearest", saturate: bool = False,
             seed: int | None = None) -> torch.Tensor:  # fmt: skip
    """``polyamp.quantize`` for a torch tensor: same values, bits and dtype rule, on ``x``'s device."""
    fmt = get_format(fmt)
    mode = _rounding(rounding)
    saturate = _flag(saturate, "saturate")
    if mode == _MODE["stochastic"]:
        seed = _seed(seed)
    elif seed is not None:
        _seed(seed)
    x = _input(x, "quantize")
    out = _round(x.to(torch.float64), fmt, mode, saturate, seed or 0)
    return out.to(_TORCH[_result_name(_NAMES[x.dtype], fmt)])


def quantize_blocks(x: torch.Tensor, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                    rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:  # fmt: skip
    """``polyamp.quantize_blocks`` for a torch tensor: same values and bits, float32 unless x is float64."""
    bf, mode, seed, rule = _blocks.arguments(fmt, scale_rule, rounding, seed)
    x = _input(x, "quantize_blocks")
    shape = _blocks._block_shape(bf, block)
    axes = _blocks._axes(axis, x.ndim, len(shape))
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if (bf.scale.name == "e8m0fnu" and bf.element.name in _FLOAT8 and mode == _MODE["nearest"]
            and dtype == torch.float32 and len(shape) == 1 and x.shape[axes[0]] % shape[0] == 0):
        return _mx_float8(x, bf, axes[0], rule)
    if bf.name == "nvfp4" and dtype == torch.float32 and _trailing(x.shape, axes, shape):
        return _nvfp4_trailing(x, bf, shape, mode, seed or 0)
    x64 = x.to(torch.float64)
    a = x64.abs()
    amax = _block_amax(a, axes, shape)
    bad = ~torch.isfinite(amax)  # NaN / inf blocks: scale NaN, elements 0
    amax = torch.where(bad, 0.0, amax)
    x64 = torch.where(_expand(bad, axes, shape, x64.shape), 0.0, x64)
    seed = seed or 0
    g = None
    if bf.scale.name == "e8m0fnu":
        k = _mx_exponent(amax, bf.element, rule)
        scales = _pow2(k)
        scaled = x64 * _pow2(-_expand(k, axes, shape, x64.shape))
        elements = _round_elements(scaled, bf.element, mode, seed, x.dtype != torch.float64)
    else:
        g = _nvfp4_global(a, x.dtype)
        scales = _round(amax / (bf.element.max * g), bf.scale, _MODE["nearest"], True, 0)
        den = _expand(scales, axes, shape, x64.shape) * g
        zero = den == 0  # s_block rounded to 0: the block holds +-0
        x64 = torch.where(zero, torch.copysign(torch.zeros_like(x64), x64), x64)
        den = torch.where(zero, 1.0, den)
        elements = _round_elements(x64 / den, bf.element, mode, seed, False)
    scales = torch.where(bad, torch.nan, scales)
    s = _expand(scales, axes, shape, elements.shape)
    v = elements * s
    if g is not None:
        v = v * g
    return torch.where(torch.isnan(s), torch.nan, v).to(dtype)


_FLOAT8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _trailing(full, axes, shape) -> bool:
    """Blocks on the last axes in order, each a whole number of blocks: a reshape holds them."""
    n = len(full)
    return tuple(axes) == tuple(range(n - len(shape), n)) and all(
        full[a] % b == 0 for a, b in zip(axes, shape))  # fmt: skip


def _nvfp4_trailing(x: torch.Tensor, bf, shape, mode: int, seed: int) -> torch.Tensor:
    """NVFP4 blocks on ``x``'s trailing axes (``_trailing``), ``x`` no wider than float32: the steps above
    on a reshape of ``x`` (the block values broadcast, none expanded), the quotient and the products in
    float64 as there, the elements by ``_round_elements`` in ``x``'s own order (the stochastic index)."""
    x32 = x.float()
    lead = x32.shape[: x32.ndim - len(shape)]
    split = [*lead]
    for n, b in zip(x32.shape[len(lead) :], shape):
        split += [n // b, b]
    inner = tuple(range(len(lead) + 1, len(split), 2))  # the within-block dims
    a = x32.abs()
    amax = a.reshape(split).amax(dim=inner, keepdim=True)  # NaN wins
    bad = ~torch.isfinite(amax)
    g = _nvfp4_global(a, x.dtype)
    scales = _round(torch.where(bad, 0.0, amax).double() / (bf.element.max * g), bf.scale, _MODE["nearest"],
                    True, 0)  # fmt: skip
    den = scales * g
    zero = den == 0  # s_block rounded to 0: the block holds +-0
    x64 = x32.double().reshape(split)
    q = torch.where(zero, torch.copysign(torch.zeros_like(x64), x64), x64 / torch.where(zero, 1.0, den))
    elements = _round_elements(q.reshape(x.shape), bf.element, mode, seed, False).reshape(split)
    v = elements * torch.where(bad, torch.nan, scales) * g
    return v.reshape(x.shape).float()


def _mx_float8(x: torch.Tensor, bf, axis: int, rule: str) -> torch.Tensor:
    """MX blocks of e4m3fn / e5m2 elements, nearest, along ``axis`` whose length the block divides, of
    ``x`` no wider than float32: the steps above in float32 (a block of whole blocks is a reshape; the
    scaled values, ``x * 2^-k``, are exact in float32 down to far below half the element's smallest
    subnormal, and torch's float8 cast rounds as ``_round`` does), then ``element * 2^k``, exact."""
    moved = torch.movedim(x.float(), axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // bf.block, bf.block)
    amax = torch.maximum(-blocks.amin(-1), blocks.amax(-1))  # no |x| tensor, faster than aminmax; NaN wins
    bad = ~torch.isfinite(amax)
    k = _mx_exponent(torch.where(bad, 0.0, amax).double(), bf.element, rule)
    fmax = float(bf.element.max)
    scaled = blocks * _pow2(-k).float().unsqueeze(-1)
    if rule not in ("rceil", "ceil"):  # these put every finite block's amax at or below the max
        scaled.clamp_(-fmax, fmax)
    elements = scaled.to(_FLOAT8[bf.element.name]).float()
    v = elements.mul_(torch.where(bad, torch.nan, _pow2(k).float()).unsqueeze(-1))
    return torch.movedim(v.reshape(moved.shape), -1, axis)


def _round_elements(scaled: torch.Tensor, elem: FloatFormat, mode: int, seed: int, narrow: bool):
    """MX elements: ``_round`` (saturating), or torch's own float8 cast where it rounds the same: nearest
    (ties to even) onto e4m3fn / e5m2 after clamping to +-max, of ``scaled`` values that float32 holds
    (``x`` no wider than float32 times a power of two; those below float32's range are far below half
    the element's smallest subnormal, 0 either way, sign kept)."""
    if mode == _MODE["nearest"] and elem.name == "e2m1fn":
        return _nearest_e2m1(scaled)
    if mode != _MODE["nearest"] or elem.name not in _FLOAT8 or not narrow:
        return _round(scaled, elem, mode, True, seed)
    fmax = float(elem.max)
    return scaled.float().clamp_(-fmax, fmax).to(_FLOAT8[elem.name]).double()


def _nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``_round(v, e2m1fn, nearest, saturate)`` of finite ``v``: e2m1's spacing is 0.5 below 2, 1 below
    4 and 2 above, so ``round(|v| / step) * step`` (ties to even at the grid's own parity) clamped to 6,
    with ``v``'s sign; the divisions by powers of two are exact."""
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return a.div_(step).round_().mul_(step).clamp_(max=6.0).copysign_(v)


# -- scalar rounding ------------------------------------------------------------------------------
def _round(v: torch.Tensor, fmt: FloatFormat, mode: int, saturate: bool, seed: int) -> torch.Tensor:
    """float64 ``v`` rounded onto ``fmt`` (module docstring), float64 out; stochastic: by flat index.

    Eager on CPU, a large tensor goes in chunks of ``_CHUNK`` elements, so that the temporaries stay
    small and are reused (one pass over 16M float64 elements otherwise spends most of its time
    faulting in fresh pages); compiled or on an accelerator it is one fused expression.
    """
    n = v.numel()
    if n <= _CHUNK or v.device.type != "cpu" or torch.compiler.is_compiling():
        return _round_flat(v, fmt, mode, saturate, seed, 0)
    flat = v.reshape(-1)
    out = torch.empty_like(flat)
    for i in range(0, n, _CHUNK):
        out[i : i + _CHUNK] = _round_flat(flat[i : i + _CHUNK], fmt, mode, saturate, seed, i)
    return out.view(v.shape)


def _round_flat(v: torch.Tensor, fmt: FloatFormat, mode: int, saturate: bool, seed: int,
                offset: int) -> torch.Tensor:  # fmt: skip
    """``_round`` of ``v``, whose first element has flat index ``offset`` in the stochastic stream."""
    overflow = fmt.max if (saturate or fmt.saturates_always) else (torch.inf if fmt.has_inf else torch.nan)
    maxval, mbits = float(fmt.max), fmt.mbits
    a = v.abs()
    e = (a.view(torch.int64) >> 52).clamp_(fmt.emin + 1023, fmt.emax + 1 + 1023)
    t = torch.sub(2046 + mbits, e).bitwise_left_shift_(52).view(torch.float64).mul_(a)  # a / q, exact
    q = e.sub_(mbits).bitwise_left_shift_(52).view(torch.float64)
    if mode == _MODE["nearest"]:
        r = t.round_().mul_(q)  # half to even
        r.masked_fill_(r > maxval, overflow)  # rounded past max
    elif mode == _MODE["toward_zero"]:
        r = t.floor_().mul_(q)
        r.masked_fill_(r > maxval, maxval)
    else:
        past = torch.round(t).mul_(q) > maxval  # nearest would overflow
        f = torch.floor(t)
        up = _uniform53(_mix(seed), v.numel(), v.device, offset).view(v.shape) < t.sub_(f)
        r = f.add_(up).mul_(q)
        r = torch.where(r > maxval, torch.where(past, overflow, maxval), r)
    r.masked_fill_(a == torch.inf, overflow)
    r.masked_fill_(torch.isnan(a), torch.nan)
    r.copysign_(v)
    if not fmt.has_negative_zero:
        r.masked_fill_(r == 0, 0.0)
    if not fmt.signed:
        r.masked_fill_(v < 0, torch.nan)
    if not fmt.subnormals:
        r = torch.where(a == 0, torch.nan, torch.where((a > 0) & (r == 0), fmt.min_normal, r))
    return r


def _uniform53(key: int, n: int, device, offset: int = 0) -> torch.Tensor:
    """The core's ``_uniform53`` of indices offset..offset+n-1 in int64: splitmix64(key + (i+1)*golden)
    >> 11, times 2^-53 (int64 multiplies wrap as uint64's do)."""
    i = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=device)
    z = i * _GOLDEN + (key - _U64 * (key >> 63))
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) * 2.0**-53


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k in float64 from exponent bits, for integer ``k`` in [-1022, 1023]."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


# -- block formats --------------------------------------------------------------------------------
def _mx_exponent(amax: torch.Tensor, elem: FloatFormat, rule: str) -> torch.Tensor:
    """The E8M0 exponent per block (``blocks._mx_exponent``), int64; ``amax`` finite, >= 0."""
    e = (amax.view(torch.int64) >> 52) - 1023  # floor(log2 amax) for normal amax; tiny ones clamp below
    k = (e - elem.emax).clamp(-128, 127)  # outside, the final clamp decides whatever the rule adds
    e = k + elem.emax
    if rule == "rceil":
        k = k + (amax > elem.max * _pow2(k)).to(torch.int64)
    elif rule == "ceil":
        k = k + (amax > _pow2(e)).to(torch.int64)
    elif rule == "even":
        k = k + (amax >= (2.0 - 2.0 ** -(elem.mbits + 1)) * _pow2(e)).to(torch.int64)
    return torch.where(amax == 0, -127, k).clamp(-127, 127)


def _nvfp4_global(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(amax / 2688) over the finite elements as a 0-d float64 tensor; 1 without one."""
    finite = torch.where(torch.isfinite(a), a, 0.0)
    amax = finite.amax() if a.numel() else torch.zeros((), dtype=torch.float64, device=a.device)
    if dtype == torch.float64:  # a 53-bit amax needs the exact quotient: the core's, on the host
        g = _blocks._nvfp4_global(np.array([amax.item()]))
        return torch.tensor(g, dtype=torch.float64, device=a.device)
    g = (amax / _blocks._NVFP4_RANGE).to(torch.float32).to(torch.float64).clamp(min=2.0**-149)
    return torch.where(amax == 0, 1.0, g)


def _block_amax(a: torch.Tensor, axes: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """max |x| over each block (NaN wins), in the scales' layout; a partial block is zero padded."""
    nb = len(axes)
    lead = a.ndim - nb
    moved = torch.movedim(a, axes, tuple(range(lead, a.ndim)))
    sizes = moved.shape[lead:]
    counts = [-(-n // b) for n, b in zip(sizes, shape)]
    pad = []
    for n, b, c in reversed(list(zip(sizes, shape, counts))):
        pad += [0, c * b - n]
    if any(pad):
        moved = F.pad(moved, pad)
    split = list(moved.shape[:lead])
    for c, b in zip(counts, shape):
        split += [c, b]
    blocked = moved.reshape(split)
    dims = tuple(lead + 2 * i + 1 for i in range(nb))
    amax = blocked.amax(dim=dims) if blocked.numel() else blocked.sum(dim=dims)
    return torch.movedim(amax, tuple(range(lead, a.ndim)), axes)


def _expand(per_block: torch.Tensor, axes, shape, full) -> torch.Tensor:
    """Each block's entry repeated over its elements: the scales' layout -> x's layout."""
    out = per_block
    for ax, b in zip(axes, shape):
        index = torch.arange(full[ax], device=out.device) // b
        out = out.index_select(ax, index)
    return out


# -- argument checking ----------------------------------------------------------------------------
def _input(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise PolyampError(f"{name} takes a torch.Tensor here, got {type(x).__name__}")
    if x.dtype not in _NAMES:
        raise PolyampError(
            f"expected a floating-point tensor, got dtype {x.dtype}; accepted: torch.float16, "
            "torch.bfloat16, torch.float32, torch.float64"
        )
    return x.detach()


__all__ = ["accepts", "quantize", "quantize_blocks"]
