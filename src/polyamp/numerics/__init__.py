"""Exact low-precision numerics in pure numpy: formats, rounding, bit codes."""

from .blocks import BLOCK_FORMATS, decode_blocks, encode_blocks, quantize_blocks
from .codes import decode, encode, neighbours
from .formats import FORMATS, FloatFormat, get_format
from .hadamard import hadamard_tiles
from .rounding import ROUNDINGS, quantize

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "ROUNDINGS",
    "FloatFormat",
    "decode",
    "decode_blocks",
    "encode",
    "encode_blocks",
    "get_format",
    "hadamard_tiles",
    "neighbours",
    "quantize",
    "quantize_blocks",
]
