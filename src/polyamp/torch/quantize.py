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

Whole blocks of input no wider than float32, in a contiguous tensor or the ``.t()`` of one, take a
faster eager route (``_plane``; MX with nearest rounding, and NVFP4): the blocks are tiles of the
storage's 2-D view (no transposed copy), the amax comes from max pools, and the element passes run
in chunks over scratch buffers kept per thread (fresh large temporaries spend most of their time
faulting pages in), MX elements rounded in float32 and NVFP4's from the core's float64 quotient by
adding and subtracting a power of two (``_mx_plane``, ``_nvfp4_plane`` say why that is exact). It
reads one flag of the data (whether any block holds NaN / inf); under ``torch.compile`` the general
route runs.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PolyampError
from ..numerics import blocks as _blocks
from ..numerics.formats import FloatFormat
from ..numerics.rounding import _MODE, _mix, _result_name, stochastic_tiles_kernel, uniform_grid_kernel
from ..numerics.rounding import arguments as _arguments

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
    fmt, mode, saturate, seed = _arguments(fmt, rounding, saturate, seed)
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
    plane = _plane(x, axes, shape) if dtype == torch.float32 else None
    if plane is not None and bf.scale.name == "e8m0fnu" and mode == _MODE["nearest"]:
        return _mx_plane(*plane, bf, rule)
    if plane is not None and bf.name == "nvfp4":
        return _nvfp4_plane(*plane, bf, mode, seed or 0)
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
        finite = torch.where(torch.isfinite(a), a, 0.0)
        g = _nvfp4_global(finite.amax() if a.numel() else finite.new_zeros(()), x.dtype)
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
_PLANE_CHUNK = 1 << 18  # most elements per pass on CPU (whole tile rows, split if wider)
_SCRATCH = threading.local()
_EXP64 = 0x7FF << 52


def _plane(x: torch.Tensor, axes, shape):
    """``(P, tile, transposed)`` when ``x``'s blocks are whole ``tile``s (rows, columns) of a contiguous
    2-D view ``P`` of its storage (``x`` is ``P`` reshaped, or ``P.t()`` if ``transposed``); else None."""
    n = x.ndim
    if n == 0 or x.numel() == 0 or torch.compiler.is_compiling():
        return None
    if x.is_contiguous():
        p, transposed = x.reshape(-1, x.shape[-1]), False
        if len(shape) == 2:
            tile = (16, 16) if sorted(axes) == [n - 2, n - 1] and x.shape[-2] % 16 == 0 else None
        else:
            tile = (1, shape[0]) if axes[0] == n - 1 else (shape[0], 1) if n == 2 else None
    elif n == 2 and x.t().is_contiguous():
        p, transposed = x.t(), True
        tile = (16, 16) if len(shape) == 2 else (shape[0], 1) if axes[0] == 1 else (1, shape[0])
    else:
        return None
    if tile is None or p.shape[0] % tile[0] or p.shape[1] % tile[1]:
        return None
    return p, tile, transposed, x.shape


def _tiles(t: torch.Tensor, tile) -> torch.Tensor:
    """The rows of ``t`` (2-D) as (row tiles, tile rows, column tiles, tile columns)."""
    return t.view(t.shape[0] // tile[0], tile[0], t.shape[1] // tile[1], tile[1])


def _passes(p: torch.Tensor, tile, count: int):
    """``p``'s passes: (rows and columns of ``p``, the same of the per-tile tensors, ``count`` 8-byte scratch
    buffers of the pass's shape). On CPU a pass is a rectangle of whole tiles of at most ``_PLANE_CHUNK``
    elements (whole rows unless a row of tiles is larger), and the buffers are kept per thread: the
    passes reuse warm memory instead of faulting in fresh pages, and there are few of them."""
    rows, cols = p.shape
    width, step = cols, rows
    if p.device.type == "cpu":
        width = min(cols, max(tile[1], _PLANE_CHUNK // tile[0] // tile[1] * tile[1]))
        step = tile[0] * max(1, _PLANE_CHUNK // (tile[0] * width))
    have = getattr(_SCRATCH, "buffers", []) if p.device.type == "cpu" else []
    if len(have) < count or have[0].numel() < step * width:
        have = [torch.empty(max(step * width, _PLANE_CHUNK), dtype=torch.float64, device=p.device)
                for _ in range(max(count, len(have)))]  # fmt: skip
        if p.device.type == "cpu":
            _SCRATCH.buffers = have
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        for c0 in range(0, cols, width):
            c1 = min(c0 + width, cols)
            m = (r1 - r0) * (c1 - c0)
            tiles = slice(r0 // tile[0], r1 // tile[0]), slice(c0 // tile[1], c1 // tile[1])
            yield (slice(r0, r1), slice(c0, c1)), tiles, [b[:m].view(r1 - r0, c1 - c0) for b in have[:count]]


def _spread(per_tile: torch.Tensor, tiles) -> torch.Tensor:
    """A pass's entries of a per-tile tensor, broadcasting over ``_tiles`` of the pass."""
    return per_tile[tiles][:, None, :, None]


def _half(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An 8-byte buffer's first half as the 4-byte ``dtype``, in the buffer's shape."""
    return buf.view(-1).view(dtype)[: buf.numel()].view(buf.shape)


def _tile_amax(p: torch.Tensor, tile) -> torch.Tensor:
    """max |x| over each tile of ``p`` (NaN wins) as float64, (row tiles, column tiles): per pass, |x| into
    a buffer, then a max pool along the rows (fast for short tiles) and a max over the tile's rows."""
    tr, tc = tile
    amax = torch.empty(p.shape[0] // tr, p.shape[1] // tc, dtype=torch.float32, device=p.device)
    for area, tiles, (buf,) in _passes(p, tile, 1):
        a = _half(buf, torch.float32).copy_(p[area]).abs_()
        if tc > 1:  # NaN wins either way
            a = F.max_pool1d(a.unsqueeze(1), tc).squeeze(1) if tc < 32 else a.view(len(a), -1, tc).amax(-1)
        torch.amax(a.view(-1, tr, a.shape[-1]), 1, out=amax[tiles])
    return amax.double()


def _signed(r: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """``r`` (>= 0 or NaN) given the sign bits ``sign`` (``x``'s, masked): copysign in one integer pass."""
    r.view(sign.dtype).bitwise_or_(sign)
    return r


def _plane_out(p: torch.Tensor, transposed: bool, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 result in ``p``'s layout, and as ``x`` (``shape``)."""
    out = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    return out, (out.t() if transposed else out.view(shape))


def _mx_plane(p: torch.Tensor, tile, transposed: bool, shape, bf, rule: str) -> torch.Tensor:
    """MX blocks, nearest, of ``x`` no wider than float32 in whole tiles (``_plane``), in float32 passes:
    ``s = x * 2^-k`` is exact down to far below half the element's smallest subnormal (smaller values
    become 0 either way); it is rounded to the element grid by ``(|s| + c) - c`` with ``c =
    2^(max(E, emin) - mbits + 23)``, E the exponent of ``|s|``: the sum lies in c's binade, whose spacing
    is the grid's at ``|s|``, so float32's addition rounds it to nearest, ties to even, and the
    subtraction is exact; then clamped to the element's max (saturation), signed, and ``* 2^k``, one
    rounding of the exact product as the core's float32 cast of it."""
    elem = bf.element
    amax = _tile_amax(p, tile)
    bad = ~torch.isfinite(amax)
    k = _mx_exponent(torch.where(bad, 0.0, amax), elem, rule)
    down, up = _pow2(-k).float(), torch.where(bad, torch.nan, _pow2(k)).float()
    low, shift, fmax = (elem.emin + 127) << 23, (23 - elem.mbits) << 23, float(elem.max)
    out, result = _plane_out(p, transposed, shape)
    for area, tiles, bufs in _passes(p, tile, 2):
        s = _tiles(out[area].copy_(p[area]), tile).mul_(_spread(down, tiles))
        sign, c = (_tiles(_half(b, torch.int32), tile) for b in bufs)
        torch.bitwise_and(s.view(torch.int32), -(1 << 31), out=sign)
        c = torch.bitwise_and(s.view(torch.int32), 0x7F800000, out=c).clamp_(min=low).add_(shift)
        c = c.view(torch.float32)
        _signed(s.abs_().add_(c).sub_(c).clamp_(max=fmax), sign).mul_(_spread(up, tiles))
    return result


def _nvfp4_plane(p: torch.Tensor, tile, transposed: bool, shape, bf, mode: int, seed: int) -> torch.Tensor:
    """NVFP4 of ``x`` no wider than float32 in whole tiles (``_plane``): the steps of the general path
    with the block values broadcast over each tile, the element passes in float64 over cached buffers.
    The quotient is the core's float64 one, ``x / (s_block * g)``; nearest rounds it onto e2m1 by
    ``(|q| + c) - c``, ``c = 2^(max(E, 0) - 1 + 52)`` (as in ``_mx_plane``: float64's addition rounds to
    e2m1's spacing at ``|q|``, ties to even, exactly as ``_round``), clamped to 6 (saturation);
    stochastic follows ``_round_flat`` with the stream indexed by position in ``x``. A block whose
    ``s_block`` is 0 divides by 1 and is multiplied by 0 (``+-0`` with x's sign, as the core's); a NaN / inf
    block by NaN. ``element * (s_block * g)`` is exact in float64 (3 + 4 + 24 bits), rounded once to
    float32 by the output's dtype. On the CPU, stochastic rounding of float32 / bfloat16 runs these
    steps as one compiled pass (``_kernel.stochastic_tiles``, numba), the same arithmetic per element."""
    amax = _tile_amax(p, tile)
    bad = ~torch.isfinite(amax)
    amax = torch.where(bad, 0.0, amax)
    gmax = amax.amax()
    if bad.any():  # a bad block's finite elements still count for the global amax
        a = p.abs()
        gmax = torch.where(torch.isfinite(a), a, 0.0).amax().double()
    g = _nvfp4_global(gmax, torch.float32)
    den = _round(amax / (bf.element.max * g), bf.scale, _MODE["nearest"], True, 0) * g
    scale, den = torch.where(bad, torch.nan, den), torch.where(den == 0, 1.0, den)
    out, result = _plane_out(p, transposed, shape)
    elem, stochastic = bf.element, mode == _MODE["stochastic"]
    compiled = stochastic_tiles_kernel() if stochastic and p.device.type == "cpu" else None
    if compiled is not None and p.dtype in (torch.float32, torch.bfloat16):
        row_step, col_step = (1, p.shape[0]) if transposed else (p.shape[1], 1)
        bf16 = p.dtype == torch.bfloat16
        compiled(p.view(torch.int16).numpy() if bf16 else p.numpy(), bf16, den.numpy(), scale.numpy(),
                 tile[0], tile[1], np.uint64(_mix(seed)), 0, row_step, col_step, elem.mbits,
                 elem.emin + 1023, elem.emax + 1024, float(elem.max), out.numpy())  # fmt: skip
        return result
    key = _mix(seed) - _U64 * (_mix(seed) >> 63)  # the stream's key as int64
    for area, tiles, bufs in _passes(p, tile, 6 if stochastic else 3):
        q = _tiles(bufs[0].copy_(p[area]), tile).div_(_spread(den, tiles))
        i64 = [_tiles(b.view(torch.int64), tile) for b in bufs[1:]]
        sign = torch.bitwise_and(q.view(torch.int64), -(1 << 63), out=i64[0])
        a = q.abs_()
        if not stochastic:
            c = torch.bitwise_and(a.view(torch.int64), _EXP64, out=i64[1])
            c = c.clamp_(min=1023 << 52).add_(51 << 52).view(torch.float64)
            r = a.add_(c).sub_(c)
        else:
            u = _plane_uniform(p, transposed, area, key, i64[3], i64[4]).view(a.shape)
            e = torch.bitwise_right_shift(a.view(torch.int64), 52, out=i64[1])
            e = e.clamp_(elem.emin + 1023, elem.emax + 1024)
            t = torch.sub(e, 2046 + elem.mbits, out=i64[2]).neg_().bitwise_left_shift_(52).view(torch.float64)
            t = t.mul_(a)  # a / q, exact
            f = torch.floor(t, out=a)
            q = e.sub_(elem.mbits).bitwise_left_shift_(52).view(torch.float64)
            r = f.add_(u.lt_(t.sub_(f))).mul_(q)
        _tiles(out[area], tile).copy_(
            _signed(r.clamp_(max=float(elem.max)), sign).mul_(_spread(scale, tiles))
        )
    return result


def _plane_uniform(p: torch.Tensor, transposed: bool, area, key: int, z: torch.Tensor,
                   tmp: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``_uniform53`` for ``p[area]``'s elements, indexed by their position in ``x``, in ``tmp``'s memory
    (float64); ``z`` and ``tmp`` are int64 scratch of the area's shape."""
    (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(area, p.shape))
    row_step, col_step = (1, p.shape[0]) if transposed else (p.shape[1], 1)
    compiled = uniform_grid_kernel() if p.device.type == "cpu" else None
    if compiled is not None:  # the same stream, compiled (numba): ~10x fewer passes over memory
        out = tmp.view(torch.float64).view(r1 - r0, c1 - c0)
        compiled(np.uint64(key % 2**64), r0 * row_step + c0 * col_step, row_step, col_step, out.numpy())
        return out
    rows, cols = torch.arange(r0, r1, device=p.device)[:, None], torch.arange(c0, c1, device=p.device)
    z = z.view(r1 - r0, c1 - c0)
    if transposed:  # p[i, j] is x[j, i]: flat index j * p.shape[0] + i
        torch.add(rows + 1, cols * p.shape[0], out=z)
    else:
        torch.add(rows * p.shape[1] + 1, cols, out=z)
    z.mul_(_GOLDEN).add_(key)
    tmp = tmp.view(z.shape)
    for s, m in ((30, _M1), (27, _M2), (31, 1)):
        z.bitwise_xor_(torch.bitwise_right_shift(z, s, out=tmp).bitwise_and_((1 << (64 - s)) - 1))
        if m != 1:
            z.mul_(m)
    z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
    return tmp.view(torch.float64).copy_(z).mul_(2.0**-53)


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


def _nvfp4_global(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(amax / 2688) as float64, from the finite amax (float64); 1 where it is 0."""
    if dtype == torch.float64:  # a 53-bit amax needs the exact quotient: the core's, on the host
        g = [_blocks._nvfp4_global(np.array([v])) for v in amax.reshape(-1).tolist()]
        return torch.tensor(g, dtype=torch.float64, device=amax.device).view(amax.shape)
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
