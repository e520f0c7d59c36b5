"""polyamp: mixed-precision training the same way on PyTorch, TensorFlow/Keras, JAX and MXNet.

Importing polyamp imports numpy and ml_dtypes only; each framework is imported by its backend when
first used.
"""

from .errors import NonFiniteError, PolyampError
from .numerics import FORMATS, ROUNDINGS, FloatFormat, decode, encode, get_format, quantize

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "FloatFormat",
    "NonFiniteError",
    "PolyampError",
    "decode",
    "encode",
    "get_format",
    "quantize",
]
