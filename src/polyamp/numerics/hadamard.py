"""NVFP4's 16x16 random Hadamard transform (RHT), defined so every framework reproduces it bit for bit.

TransformerEngine's NVFP4 recipe multiplies the weight-gradient GEMM's operands (the column-wise
copies of the input ``x`` and of the output gradient ``g``, contraction along the tokens ``M``) by
``H = (1/4) * S * H16`` in tiles of 16 along ``M`` before quantizing them. ``H16`` is the 16x16
Sylvester Hadamard matrix (``H16[i, j] = (-1)^popcount(i & j)``) and ``S = diag(SIGNS)``, one fixed
sign vector for every layer. ``H`` is orthogonal (``H16 H16^T = 16 I``), so
``(g^T H)(x^T H)^T = g^T x``: the transform changes only what the quantizer sees.

:func:`hadamard_tiles` computes ``v @ H`` for each tile ``v`` of 16 along ``axis``, in float32:

1. ``x`` as float32 (float16 / bfloat16 exactly, float64 rounded to nearest); ``axis`` padded with
   zeros at its end to a multiple of 16 (pad both GEMM operands the same way and the padded product
   equals the unpadded one); the result keeps that padded length;
2. ``v * SIGNS`` (exact);
3. the fast Walsh-Hadamard butterfly in natural (Sylvester) order, four float32 stages with the
   half-width ``h = 1, 2, 4, 8`` in that order: in each group of ``2h`` consecutive entries, the
   first ``h`` (``a``) and the next ``h`` (``b``) become ``a + b`` and ``a - b``;
4. ``* 0.25`` (exact, except that a result in float32's subnormal range is rounded).

Every step is an elementwise IEEE float32 operation in a fixed order, so a framework that writes the
same four stages gets the same bits. A NaN or inf in a tile makes every value of that tile NaN or
inf (``inf - inf`` is NaN); a partial sum beyond float32's range overflows to inf before the final
quarter (possible once a tile holds ``|x|`` above 2^124), and so spoils its tile the same way.

``SIGNS`` is ``-1`` where bit ``i`` of the first splitmix64 output for seed 0 (``0xE220A8397B1DCDAF``,
splitmix64 as in ``rounding.py``) is set, ``+1`` where it is clear, for ``i = 0 .. 15``. (TE hard-codes
another vector, ``nvfp4_tensor.py::get_wgrad_sign_vector``; any fixed choice is orthogonal.)
"""

from __future__ import annotations

import numpy as np

from ..errors import PolyampError
from .rounding import _as_float_array, _mix

TILE = 16
SIGN_SEED = 0
SIGNS = np.array([-1.0 if (_mix(SIGN_SEED) >> i) & 1 else 1.0 for i in range(TILE)], dtype=np.float32)
SIGNS.flags.writeable = False
STAGES = (1, 2, 4, 8)  # the butterfly's half-widths, in order


def hadamard_matrix() -> np.ndarray:
    """The dense ``H = (1/4) * diag(SIGNS) @ H16`` (float64), the matrix :func:`hadamard_tiles` applies
    to each tile as ``v @ H``."""
    h16 = np.ones((1, 1))
    for _ in STAGES:  # Sylvester: H_2n = [[H_n, H_n], [H_n, -H_n]]
        h16 = np.block([[h16, h16], [h16, -h16]])
    return 0.25 * SIGNS.astype(np.float64)[:, None] * h16


def hadamard_tiles(x, axis: int = -1) -> np.ndarray:
    """``x`` times ``H`` in tiles of 16 along ``axis`` (module docstring), float32, ``axis`` zero padded
    to a multiple of 16.

    >>> g, x = np.float32([[1, -2, 3]]), np.float32([[0.5, 4, -1]])
    >>> hadamard_tiles(g).shape, (hadamard_tiles(g) @ hadamard_tiles(x).T).item(), (g @ x.T).item()
    ((1, 16), -10.5, -10.5)
    """
    if type(x).__module__.split(".")[0] in ("torch", "tensorflow", "jax", "jaxlib", "mxnet"):
        raise PolyampError(
            f"hadamard_tiles takes a numpy float array, got a {type(x).__module__}.{type(x).__name__}; "
            "use the framework's own (polyamp.torch.hadamard.hadamard_tiles) or convert with np.asarray"
        )
    if isinstance(x, (list, tuple)) or np.ndim(x) == 0:
        raise PolyampError(
            f"hadamard_tiles takes a numpy float array of 1 or more dimensions, got {type(x).__name__}"
            + (f" of shape {np.shape(x)}" if hasattr(x, "shape") else f" {x!r}"[:80])
        )
    arr = _as_float_array(x)
    axis = _axis(axis, arr.ndim)
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, as a cast does
        v = np.moveaxis(arr.astype(np.float32), axis, -1)
    n = v.shape[-1]
    pad = -n % TILE
    if pad:
        v = np.concatenate([v, np.zeros((*v.shape[:-1], pad), np.float32)], axis=-1)
    lead = v.shape[:-1]
    tiles = (n + pad) // TILE
    t = v.reshape(*lead, tiles, TILE) * SIGNS
    with np.errstate(over="ignore", invalid="ignore"):  # inf - inf is NaN, as the docstring says
        for h in STAGES:
            pairs = t.reshape(*lead, tiles, TILE // (2 * h), 2, h)
            a, b = pairs[..., 0, :], pairs[..., 1, :]
            t = np.stack([a + b, a - b], axis=-2)
    out = (t * np.float32(0.25)).reshape(*lead, n + pad)
    return np.moveaxis(out, -1, axis)


def _axis(axis, ndim: int) -> int:
    integer = isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_))
    if not (integer and -ndim <= axis < ndim):
        raise PolyampError(f"axis {axis!r} is not an axis of a {ndim}-d array; accepted: integers in "
                           f"[{-ndim}, {ndim})")  # fmt: skip
    return int(axis) % ndim
