"""polyamp: mixed-precision training the same way on PyTorch, TensorFlow/Keras, JAX and MXNet.

Importing polyamp imports numpy and ml_dtypes only; each framework is imported by its backend when
first used.
"""

from . import doctor, tune
from .errors import NonFiniteError, PolyampError, UnsupportedError
from .mixed_precision import MixedPrecision
from .native import from_native, to_native
from .numerics import (
    BLOCK_FORMATS,
    FORMATS,
    ROUNDINGS,
    FloatFormat,
    decode,
    decode_blocks,
    encode,
    encode_blocks,
    get_format,
    quantize,
    quantize_blocks,
)
from .policy import Policy
from .scaling import DynamicLossScale, LossScale, LossScaleState, NoLossScale, StaticLossScale
from .step import StepResult

__version__ = "0.1.0"

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "ROUNDINGS",
    "DynamicLossScale",
    "FloatFormat",
    "LossScale",
    "LossScaleState",
    "MixedPrecision",
    "NoLossScale",
    "NonFiniteError",
    "Policy",
    "PolyampError",
    "StaticLossScale",
    "StepResult",
    "UnsupportedError",
    "decode",
    "decode_blocks",
    "doctor",
    "tune",
    "encode",
    "encode_blocks",
    "from_native",
    "get_format",
    "quantize",
    "quantize_blocks",
    "to_native",
]
