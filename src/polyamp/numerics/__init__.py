"""Exact low-precision numerics in pure numpy: formats, rounding, bit codes."""

from .codes import decode, encode, neighbours
from .formats import FORMATS, FloatFormat, get_format
from .rounding import ROUNDINGS, quantize

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "FloatFormat",
    "decode",
    "encode",
    "get_format",
    "neighbours",
    "quantize",
]
