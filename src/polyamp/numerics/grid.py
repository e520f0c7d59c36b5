"""What an exact integer rounding kernel needs of a format, as plain numbers.

The JAX and TensorFlow front ends round with integer ops (``polyamp/jax/quantize.py``,
``polyamp/tensorflow/quantize.py``); both take a format as this ``Grid``: its mantissa bits, exponent
range, largest value as ``fm * 2^(emax - mbits)`` (``fm`` an integer significand), what overflow gives
(the max if ``ovf_max``, else NaN if ``ovf_nan``, else inf) and its sign and zero conventions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .formats import FloatFormat


class Grid(NamedTuple):
    """A format as ``_round`` sees it (module docstring): Python values, or numpy scalars from
    :meth:`arrays` (traced arguments, so one compilation serves every format)."""

    mbits: int
    emin: int
    emax: int
    fm: int
    ovf_max: bool
    ovf_nan: bool
    pos_zero: bool
    signed: bool
    subnormals: bool

    @classmethod
    def of(cls, fmt: FloatFormat, saturate: bool) -> Grid:
        ovf_max = saturate or fmt.saturates_always
        fm = int(fmt.max * 2.0 ** (fmt.mbits - fmt.emax))
        return cls(fmt.mbits, fmt.emin, fmt.emax, fm, ovf_max, not ovf_max and not fmt.has_inf,
                   not fmt.has_negative_zero, fmt.signed, fmt.subnormals)  # fmt: skip

    def arrays(self) -> Grid:
        return Grid(*(np.int32(v) if isinstance(v, int) and not isinstance(v, bool) else np.bool_(v)
                      for v in self))  # fmt: skip


FLOAT64 = Grid(52, -1022, 1023, (1 << 53) - 1, False, False, False, True, True)
