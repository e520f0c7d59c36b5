"""glibc malloc's modes (``polyamp/tune/allocator.py``): heap mode keeps a freed large block's pages for the
next allocation (counted as minor page faults), default mode maps them afresh; bad modes are refused."""

import resource

import numpy as np
import pytest

from polyamp import PolyampError
from polyamp.tune import allocator

pytestmark = pytest.mark.skipif(not allocator.available(), reason="glibc's mallopt only (Linux)")


def _faults_per_block(n: int = 6, size: int = 48 << 20) -> float:
    """Minor page faults per allocate-fill-free of a ``size``-byte block, after one warm-up round."""
    np.ones(size // 8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        block = np.ones(size // 8)
        del block
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n


def test_heap_mode_reuses_a_freed_blocks_pages_and_default_mode_maps_them_again():
    try:
        allocator.use("default")
        mapped = _faults_per_block()
        allocator.use("heap")
        assert allocator.current() == "heap"
        reused = _faults_per_block()
        allocator.use("default")
        again = _faults_per_block()
    finally:
        allocator.use("default")
    huge_pages = (48 << 20) >> 21  # a fresh mapping faults in every page: 4 KiB ones, or 2 MiB huge ones
    assert mapped >= huge_pages and again >= huge_pages
    assert reused < mapped / 10


def test_bad_modes_are_refused_and_change_nothing():
    with pytest.raises(PolyampError, match=r"'mmap' unknown; accepted: default, heap"):
        allocator.use("mmap")
    assert allocator.current() == "default"
