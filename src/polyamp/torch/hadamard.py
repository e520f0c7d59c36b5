"""NVFP4's 16x16 random Hadamard transform on torch tensors, bit-identical to the numpy core.

``polyamp.numerics.hadamard`` defines the transform and its steps; this runs the same steps as torch
ops on ``x``'s device: float32 of ``x``, zero padding of ``axis`` to a multiple of 16, the product with
the core's ``SIGNS``, the four butterfly stages (half-widths 1, 2, 4, 8; ``a + b`` / ``a - b``), then
``* 0.25``. Each is one elementwise float32 operation, which torch rounds as numpy does (no fused
multiply-add in eager mode, subnormals kept), so the bits agree (``tests/test_torch_recipes.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    v = x.detach().float().movedim(axis, -1)
    n = v.shape[-1]
    v = F.pad(v, (0, -n % TILE))
    lead = v.shape[:-1]
    tiles = v.shape[-1] // TILE
    signs = _SIGNS.get(v.device)
    if signs is None:
        signs = _SIGNS[v.device] = torch.from_numpy(SIGNS.copy()).to(v.device)
    t = v.reshape(*lead, tiles, TILE) * signs
    for h in STAGES:
        pairs = t.reshape(*lead, tiles, TILE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        t = torch.stack([a + b, a - b], dim=-2)
    return (t * 0.25).reshape(*lead, tiles * TILE).movedim(-1, axis)
