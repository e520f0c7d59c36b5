"""``quantize`` and ``quantize_blocks`` on TensorFlow tensors, in integer TF ops, bit-identical to the core.

``polyamp.quantize`` / ``polyamp.quantize_blocks`` call these for a ``tf.Tensor`` or ``tf.Variable``;
they take the same arguments and give the same values, bits and result dtype as
``polyamp.numerics.rounding`` / ``blocks`` (read those docstrings for the rules). Every step is a TF
op with no Python branch on the data, so both run eagerly, inside ``tf.function`` and under
``jit_compile=True`` alike.

Why integers: eager TensorFlow on the CPU flushes float32 subnormals (inputs and results: ``1e-40 *
1.0 == 0`` and ``reduce_max(abs(1e-40)) == 0`` there) while ``tf.function`` does not, so float
arithmetic cannot reproduce the core. The algorithm is ``polyamp.numerics.exact_int``'s, over this
front end's ops (``xp_int.py``: uint64 significands); here only TF's own parts: the splitmix64 stream of
(seed, flat index + 1) in uint64 arithmetic (which wraps mod 2^64 as the core's does), ``key_of`` and
``graph_call``.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from ..errors import PolyampError
from ..numerics import blocks as _blocks
from ..numerics import exact_int
from ..numerics.formats import FloatFormat
from ..numerics.grid import Grid as _Grid
from ..numerics.rounding import _MODE, _result_name
from ..numerics.rounding import arguments as _arguments
from ..numerics.stream import GOLDEN, M1, M2
from ..numerics.stream import mix as _mix
from . import xp_int
from .xp_int import LAYOUT as _LAYOUT
from .xp_int import U as _U

_INPUT_NAMES = ", ".join(d.name for d in _LAYOUT)
_STOCHASTIC = _MODE["stochastic"]


def accepts(x) -> bool:
    """Whether ``x`` is a tensor this module quantizes (the core's dispatch asks)."""
    return isinstance(x, (tf.Tensor, tf.Variable))


def quantize(x, fmt, rounding: str = "nearest", saturate: bool = False, seed: int | None = None):
    """``polyamp.quantize`` for a TF tensor: same values, bits and dtype rule, as TF ops."""
    fmt, mode, saturate, seed = _arguments(fmt, rounding, saturate, seed)
    x = _input(x, "quantize")
    return quantize_keyed(x, fmt, mode, saturate, key_of(seed or 0))


def quantize_keyed(x, fmt: FloatFormat, mode: int, saturate: bool, key):
    """``quantize`` with the stream's key (``key_of(seed)``, a uint64 scalar tensor) given."""
    stream = _Stream(key, x) if mode == _STOCHASTIC else None
    num = exact_int.decompose(xp_int, x)
    out = exact_int.round_to_grid(xp_int, num, _Grid.of(fmt, saturate), mode, stream)
    return compose(out, tf.as_dtype(_result_name(x.dtype.name, fmt)))


def graph_call(fn, tensors: tuple, static: tuple):
    """``fn(*tensors, *static)`` through a ``tf.function`` made once per (fn, shapes, dtypes, static):
    eagerly one graph run instead of thousands of eager ops, in a trace one call of a function traced
    once per shape (the recipe's kernels, called every step on the same shapes)."""
    signature = tuple((tuple(t.shape.as_list()), t.dtype) for t in tensors)
    return _graph(fn, signature, static)(*tensors)


@functools.lru_cache(maxsize=512)
def _graph(fn, signature, static):
    return tf.function(lambda *tensors: fn(*tensors, *static), autograph=False)


def key_of(seed):
    """The stream's key ``rounding._mix(seed)`` as a uint64 scalar: from a Python int, or (traced) from
    an integer tensor (a step counter in a ``tf.Variable``)."""
    if isinstance(seed, (int, np.integer)):
        return tf.constant(_mix(int(seed)), _U)
    return _splitmix(tf.cast(seed, _U) + xp_int.graph_const(GOLDEN, _U))


def _splitmix(z):
    """splitmix64's output mix of the uint64 words ``z``."""
    z = (z ^ xp_int.shift_right(z, 30)) * xp_int.graph_const(M1, _U)
    z = (z ^ xp_int.shift_right(z, 27)) * xp_int.graph_const(M2, _U)
    return z ^ xp_int.shift_right(z, 31)


def quantize_blocks(x, fmt: str, axis=-1, block=None, scale_rule: str | None = None,
                    rounding: str = "nearest", seed: int | None = None):  # fmt: skip
    """``polyamp.quantize_blocks`` for a TF tensor: same values and bits, float32 unless x is float64."""
    bf, mode, seed, rule = _blocks.arguments(fmt, scale_rule, rounding, seed)
    x = _input(x, "quantize_blocks")
    shape = _blocks._block_shape(bf, block)
    axes = _blocks._axes(axis, x.shape.rank, len(shape))
    return blocks_keyed(x, bf, axes, shape, rule, mode, key_of(seed or 0))


def blocks_keyed(x, bf, axes, shape, rule, mode, key):
    """The values of ``quantize_blocks`` (arguments checked), as in ``blocks._Encoding.of``."""
    stream = _Stream(key, x) if mode == _STOCHASTIC else None
    mx = bf.scale.name == "e8m0fnu"
    code = _blocks.SCALE_RULES.index(rule) if mx else None
    elem = _Grid.of(bf.element, True)
    return exact_int.block_values(xp_int, x, None if mx else bf, elem, code, axes, shape, mode, stream, _U)


def compose(num: exact_int.Num, dtype) -> tf.Tensor:
    """The bit pattern of ``num`` in ``dtype``: exact for values it holds, inf beyond its range."""
    return exact_int.compose(xp_int, num, dtype)


class _Stream:
    """The core's uniform stream ``_uniform53``: splitmix64 of ``key + (i + 1) * golden`` for the flat
    index ``i`` (uint64, wrapping); ``u = z53 / 2^53`` with ``z53 = z >> 11``."""

    def __init__(self, key, x) -> None:
        """The stream over ``x``'s elements (its shape may be known only when it runs)."""
        if x.shape.is_fully_defined():
            n, shape = int(np.prod(x.shape.as_list(), dtype=np.int64)), x.shape.as_list()
        else:
            shape = tf.shape(x, out_type=tf.int64)
            n = tf.reduce_prod(shape)
        i = tf.reshape(tf.cast(tf.range(1, n + 1, dtype=tf.int64), _U), shape)
        self.z53 = xp_int.shift_right(_splitmix(key + i * xp_int.graph_const(GOLDEN, _U)), 11)

    def below(self, rem, s) -> tf.Tensor:
        """``u < rem / 2^s`` exactly (rem < 2^s), as ``z53 * 2^s < rem * 2^53``."""
        k = 53 - s
        small = self.z53 < exact_int.shl(xp_int, rem, k)
        below_rem = exact_int.shr(xp_int, rem - xp_int.graph_const(1, _U), -k)
        large = tf.not_equal(rem, 0) & (self.z53 <= below_rem)
        return tf.where(s <= 53, small, large)


# -- argument checking ---------------------------------------------------------------------------------
def _input(x, name: str):
    if not accepts(x):
        raise PolyampError(f"polyamp.tensorflow.quantize.{name} takes a TensorFlow tensor, "
                           f"got {type(x).__name__}")  # fmt: skip
    if x.dtype not in _LAYOUT:
        raise PolyampError(
            f"expected a floating-point tensor, got dtype {x.dtype.name}; accepted: {_INPUT_NAMES}"
        )
    if not x.shape.is_fully_defined():
        raise PolyampError(f"polyamp.tensorflow.quantize.{name} needs a static shape, got {x.shape}")
    return tf.convert_to_tensor(x)


__all__ = ["accepts", "compose", "key_of", "quantize", "quantize_blocks"]
