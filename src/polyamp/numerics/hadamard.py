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

On TensorFlow tensors and on JAX arrays on the CPU, whose float32 kernels flush subnormal inputs and
results to zero, a tile whose values or partial sums fall below 2^-126 in magnitude differs from the
core's there (``tests/test_recipes_frameworks.py`` counts such cases and marks them as known failures);
torch, MXNet and numpy keep subnormals.

``SIGNS`` is ``-1`` where bit ``i`` of the first splitmix64 output for seed 0 (``0xE220A8397B1DCDAF``,
splitmix64 as in ``rounding.py``) is set, ``+1`` where it is clear, for ``i = 0 .. 15``. (TE hard-codes
another vector, ``nvfp4_tensor.py::get_wgrad_sign_vector``; any fixed choice is orthogonal.)
"""

from __future__ import annotations

import numpy as np

from ..errors import PolyampError
from ..frameworks import ops_of
from .rounding import _as_float_array
from .stream import mix as _mix

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


def hadamard_tiles(x, axis: int = -1):
    """``x`` times ``H`` in tiles of 16 along ``axis`` (module docstring), float32, ``axis`` zero padded
    to a multiple of 16. ``x`` a numpy float array, or a tensor of an imported framework (torch, TF, JAX,
    MXNet NDArray), run there over its ops module (``polyamp.<framework>.xp``, no host copy; the result
    never requires grad).

    >>> g, x = np.float32([[1, -2, 3]]), np.float32([[0.5, 4, -1]])
    >>> hadamard_tiles(g).shape, (hadamard_tiles(g) @ hadamard_tiles(x).T).item(), (g @ x.T).item()
    ((1, 16), -10.5, -10.5)
    """
    ops = ops_of(x)
    if ops is None:
        ops, x = _NUMPY, _numpy_operand(x)
    rank = _checked_rank(ops, x)
    axis = _axis(axis, rank)
    t = ops.float32_tiles(x, axis, TILE)  # [*lead, tiles, TILE, *rest], split in place (no axis moves)
    t = ops.times(t, SIGNS.reshape(TILE, *[1] * (rank - axis - 1)))
    for h in STAGES:
        t = ops.butterfly(t, axis + 1, h)
    return ops.merge_tiles(ops.times(t, np.float32(0.25)), axis)


def _numpy_operand(x) -> np.ndarray:
    if type(x).__module__.split(".")[0] in ("torch", "tensorflow", "jax", "jaxlib", "mxnet"):
        raise PolyampError(
            f"hadamard_tiles takes a numpy float array or a tensor of an imported framework, got a "
            f"{type(x).__module__}.{type(x).__name__} its front end does not take; convert it with np.asarray"
        )
    if isinstance(x, (list, tuple)) or np.ndim(x) == 0:
        raise PolyampError(
            f"hadamard_tiles takes a numpy float array of 1 or more dimensions, got {type(x).__name__}"
            + (f" of shape {np.shape(x)}" if hasattr(x, "shape") else f" {x!r}"[:80])
        )
    return _as_float_array(x)


def _checked_rank(ops, x) -> int:
    dtype, shape = ops.tensor_facts(x)
    if dtype not in _FLOATS or not shape:
        raise PolyampError(f"hadamard_tiles takes a float16/bfloat16/float32/float64 tensor of 1 or more "
                           f"dimensions; received a {ops.NAME}.{dtype} tensor of shape {shape}")  # fmt: skip
    return len(shape)


class _NUMPY:
    """The ops :func:`hadamard_tiles` runs over, for a numpy array."""

    NAME = "numpy"

    @staticmethod
    def tensor_facts(x):
        return x.dtype.name, x.shape

    @staticmethod
    def float32_tiles(x, axis, tile):
        with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, as a cast does
            v = x.astype(np.float32)
        pad = [(0, 0)] * v.ndim
        pad[axis] = (0, -v.shape[axis] % tile)
        v = np.pad(v, pad)
        return v.reshape(*v.shape[:axis], v.shape[axis] // tile, tile, *v.shape[axis + 1 :])

    @staticmethod
    def times(t, c):
        with np.errstate(over="ignore", invalid="ignore"):
            return t * c

    @staticmethod
    def butterfly(t, axis, h):
        pairs = t.reshape(*t.shape[:axis], t.shape[axis] // (2 * h), 2, h, *t.shape[axis + 1 :])
        a, b = np.take(pairs, 0, axis + 1), np.take(pairs, 1, axis + 1)
        with np.errstate(over="ignore", invalid="ignore"):  # inf - inf is NaN, as the docstring says
            return np.stack([a + b, a - b], axis=axis + 1).reshape(t.shape)

    @staticmethod
    def merge_tiles(t, axis):
        return t.reshape(*t.shape[:axis], t.shape[axis] * t.shape[axis + 1], *t.shape[axis + 2 :])


_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _axis(axis, ndim: int) -> int:
    integer = isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_))
    if not (integer and -ndim <= axis < ndim):
        raise PolyampError(f"axis {axis!r} is not an axis of a {ndim}-d array; accepted: integers in "
                           f"[{-ndim}, {ndim})")  # fmt: skip
    return int(axis) % ndim
