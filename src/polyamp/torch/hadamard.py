"""NVFP4's 16x16 random Hadamard transform on torch tensors, bit-identical to the numpy core.

``polyamp.numerics.hadamard`` defines the transform and its steps; this runs the same steps as torch
ops on ``x``'s device: float32 of ``x``, zero padding of ``axis`` to a multiple of 16, the product with
the core's ``SIGNS``, the four butterfly stages (half-widths 1, 2, 4, 8; ``a + b`` / ``a - b``), then
``* 0.25``. Each is one elementwise float32 operation, which torch rounds as numpy does (no fused
multiply-add in eager mode, subnormals kept), so the bits agree (``tests/test_torch_recipes.py``).
"""

from __future__ import annotations

import torch

from ..errors import PolyampError
from ..numerics.hadamard import SIGNS, STAGES, TILE

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SIGNS: dict[torch.device, torch.Tensor] = {}  # the core's SIGNS on each device, copied there once


def hadamard_tiles(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """``polyamp.numerics.hadamard_tiles`` for a torch tensor: float32, ``axis`` zero padded to a
    multiple of 16, on ``x``'s device; the result never requires grad."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() == 0:
        tensor = isinstance(x, torch.Tensor)
        what = f"a {x.dtype} tensor of shape {tuple(x.shape)}" if tensor else type(x).__name__
        raise PolyampError(f"hadamard_tiles takes a float16/bfloat16/float32/float64 tensor of 1 or more "
                           f"dimensions; received {what}")  # fmt: skip
    ndim = x.dim()
    integer = isinstance(axis, int) and not isinstance(axis, bool)
    if not (integer and -ndim <= axis < ndim):
        raise PolyampError(f"axis {axis!r} is not an axis of a {ndim}-d tensor; accepted: integers in "
                           f"[{-ndim}, {ndim})")  # fmt: skip
    axis %= ndim
    n, lead, rest = x.shape[axis], x.shape[:axis], x.shape[axis + 1 :]
    tiles = -(-n // TILE)
    signs = _SIGNS.get(x.device)
    if signs is None:
        signs = _SIGNS[x.device] = torch.from_numpy(SIGNS.copy()).to(x.device)
    # tiles split in place along ``axis`` (no transposed copy), the stages ping-ponging between two buffers
    t = torch.zeros(*lead, tiles * TILE, *rest, dtype=torch.float32, device=x.device)
    t.narrow(axis, 0, n).copy_(x.detach())
    t = t.view(*lead, tiles, TILE, *rest).mul_(signs.view(TILE, *[1] * len(rest)))
    u = torch.empty_like(t)
    for h in STAGES:
        pairs = (*lead, tiles, TILE // (2 * h), 2, h, *rest)
        a, b = t.view(pairs).unbind(axis + 2)
        s, d = u.view(pairs).unbind(axis + 2)
        torch.add(a, b, out=s)
        torch.sub(a, b, out=d)
        t, u = u, t
    return t.mul_(0.25).view(*lead, tiles * TILE, *rest)
