"""One tensor's binning as one int64 vector: what a compiled or on-device binning hands back.

Layout: the ``N_BINS`` counts of ``histogram.py``, then zeros, non-finite, apart (update ratios of a zero
weight), and the largest and smallest key of the counted values (``NONE`` when there is none). A value's
key is its float32 magnitude bits; an update ratio's, ``(b(u) - b(w) + 512) << 23 | f(u)`` for
``|u| = 2^b(u) * (1 + f(u) / 2^23)``: the ratio ``2^(b(u) - b(w)) * (1 + f(u) / 2^23)``, ordered as an
integer (float32's exponents keep ``b(u) - b(w) + 512`` in [235, 789]).
"""

from __future__ import annotations

import struct

import numpy as np

from .histogram import N_BINS

ZEROS, NONFINITE, APART, HIGH, LOW = range(N_BINS, N_BINS + 5)
LENGTH = N_BINS + 5
NONE = -1
KEY_BIAS = 512 << 23  # key - ((b(u) - b(w)) << 23 | f(u))


def ratio_value(key: int) -> float:
    """The update ratio whose key is ``key``, exactly."""
    return float(np.ldexp(float((1 << 23) | (key & 0x7FFFFF)), (key >> 23) - 512 - 23))


def magnitude(bits: int) -> float:
    """The float32 whose bits are ``bits``."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def fields(v: np.ndarray, ratio: bool) -> dict:
    """The vector ``v`` as ``LogHistogram.from_counts``' arguments (counts copied)."""
    value = ratio_value if ratio else magnitude
    high, low = int(v[HIGH]), int(v[LOW])
    return {
        "counts": np.array(v[:N_BINS], np.int64),
        "zeros": int(v[ZEROS]),
        "nonfinite": int(v[NONFINITE]),
        "amax": value(high) if high != NONE else 0.0,
        "amin_nonzero": value(low) if low != NONE else None,
        "apart": int(v[APART]),
    }
