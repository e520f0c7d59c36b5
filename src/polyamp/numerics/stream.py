"""splitmix64, the counter-based stream behind every stochastic rounding in polyamp.

Element ``i`` (flat index, 0-based) of a call with key ``k = mix(seed)`` draws
``u = z53 / 2^53`` where ``z = splitmix64_finalize(k + (i + 1) * GOLDEN)`` and ``z53 = z >> 11``
(all arithmetic mod 2^64), so a result depends on (seed, element index) only, never on threads,
chunking or device. Every front end reproduces these bits with its own integer ops.
"""

from __future__ import annotations

GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def mix(seed: int) -> int:
    """splitmix64 of the seed, so that nearby seeds give unrelated streams."""
    z = (seed + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * M1) & MASK64
    z = ((z ^ (z >> 27)) * M2) & MASK64
    return z ^ (z >> 31)


def uniform53(ops, key: int, n: int, like, offset: int = 0):
    """``u`` of the elements with flat indices ``offset .. offset + n - 1``, float64 in ``ops``' arrays on
    ``like``'s device, from 64-bit words (``ops.words``: uint64, or int64 whose multiplies wrap alike)."""
    z = ops.words(offset + 1, offset + n + 1, like) * ops.word(GOLDEN, like) + ops.word(key, like)
    z = ops.xor(z, ops.shr(z, 30)) * ops.word(M1, like)
    z = ops.xor(z, ops.shr(z, 27)) * ops.word(M2, like)
    return ops.unit53(ops.xor(z, ops.shr(z, 31)))
