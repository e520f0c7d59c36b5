"""torch's measured fast path of ``quantize_blocks``, an override of the core's float64 route
(``polyamp.numerics.exact_float``), bit for bit the same values.

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

from ..numerics import exact_float
from ..numerics.rounding import stochastic_tiles_kernel, uniform_grid_kernel
from ..numerics.stream import GOLDEN, M1, M2, mix

_PLANE_CHUNK = 1 << 18  # most elements per pass on CPU (whole tile rows, split if wider)
_SCRATCH = threading.local()
_EXP64 = 0x7FF << 52
_NEAREST, _STOCHASTIC = exact_float.NEAREST, exact_float.STOCHASTIC


def fast_blocks(ops, x: torch.Tensor, bf, axes, shape, rule, mode: int, seed: int):
    """The values of ``quantize_blocks`` (arguments checked) when ``x`` (no wider than float32) is whole
    blocks of a plane (``_plane``) and the format and rounding have a pass here; else None. ``ops``: torch's
    ops module (``polyamp.torch.xp``)."""
    plane = _plane(x, axes, shape)
    if plane is not None and bf.scale.name == "e8m0fnu" and mode == _NEAREST:
        return _mx_plane(ops, *plane, bf, rule)
    if plane is not None and bf.name == "nvfp4":
        return _nvfp4_plane(ops, *plane, bf, mode, seed)
    return None


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


def _mx_plane(ops, p: torch.Tensor, tile, transposed: bool, shape, bf, rule: str) -> torch.Tensor:
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
    k = exact_float.mx_exponent(ops, torch.where(bad, 0.0, amax), elem, rule)
    down, up = ops.pow2(-k).float(), torch.where(bad, torch.nan, ops.pow2(k)).float()
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


def _nvfp4_plane(ops, p: torch.Tensor, tile, transposed: bool, shape, bf, mode: int, seed: int):
    """NVFP4 of ``x`` no wider than float32 in whole tiles (``_plane``): the steps of the general path
    with the block values broadcast over each tile, the element passes in float64 over cached buffers.
    The quotient is the core's float64 one, ``x / (s_block * g)``; nearest rounds it onto e2m1 by
    ``(|q| + c) - c``, ``c = 2^(max(E, 0) - 1 + 52)`` (as in ``_mx_plane``: float64's addition rounds to
    e2m1's spacing at ``|q|``, ties to even, exactly as ``exact_float.round_float64``), clamped to 6;
    stochastic follows ``exact_float.round_float64``, the stream indexed by position in ``x``. A block whose
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
    g = exact_float.nvfp4_global_of(ops, gmax, False)
    den = ops.round_float64(amax / (g * bf.element.max), bf.scale, _NEAREST, True, 0) * g
    scale, den = torch.where(bad, torch.nan, den), torch.where(den == 0, 1.0, den)
    out, result = _plane_out(p, transposed, shape)
    elem, stochastic = bf.element, mode == _STOCHASTIC
    compiled = stochastic_tiles_kernel() if stochastic and p.device.type == "cpu" else None
    if compiled is not None and p.dtype in (torch.float32, torch.bfloat16):
        row_step, col_step = (1, p.shape[0]) if transposed else (p.shape[1], 1)
        bf16 = p.dtype == torch.bfloat16
        compiled(p.view(torch.int16).numpy() if bf16 else p.numpy(), bf16, den.numpy(), scale.numpy(),
                 tile[0], tile[1], np.uint64(mix(seed)), 0, row_step, col_step, elem.mbits,
                 elem.emin + 1023, elem.emax + 1024, float(elem.max), out.numpy())  # fmt: skip
        return result
    key = ops.word(mix(seed), p)  # the stream's key as int64
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
            u = _plane_uniform(ops, p, transposed, area, key, i64[3], i64[4]).view(a.shape)
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


def _plane_uniform(ops, p: torch.Tensor, transposed: bool, area, key: int, z: torch.Tensor,
                   tmp: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``stream.uniform53`` for ``p[area]``'s elements, indexed by their position in ``x``, in ``tmp``'s
    memory (float64); ``z`` and ``tmp`` are int64 scratch of the area's shape."""
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
    z.mul_(ops.word(GOLDEN, z)).add_(key)
    tmp = tmp.view(z.shape)
    for s, m in ((30, ops.word(M1, z)), (27, ops.word(M2, z)), (31, 1)):
        z.bitwise_xor_(torch.bitwise_right_shift(z, s, out=tmp).bitwise_and_((1 << (64 - s)) - 1))
        if m != 1:
            z.mul_(m)
    z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)
    return tmp.view(torch.float64).copy_(z).mul_(2.0**-53)
