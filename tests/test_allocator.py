"""glibc malloc's modes (``polyamp/tune/allocator.py``): heap mode keeps a freed large block's pages for the
next allocation (counted as minor page faults), default mode maps them afresh; bad modes are refused."""

import subprocess
import sys

import pytest

from polyamp import PolyampError
from polyamp.tune import allocator

pytestmark = pytest.mark.skipif(not allocator.available(), reason="glibc's mallopt only (Linux)")


# minor page faults per allocate-fill-free of a 48 MiB block (after one warm-up round), in each mode
CHILD = """
import resource, sys
import numpy as np
from polyamp.tune import allocator

def faults_per_block(n=6, size=48 << 20):
    np.ones(size // 8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        block = np.ones(size // 8)
        del block
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n

allocator.use("default")
mapped = faults_per_block()
allocator.use("heap")
assert allocator.current() == "heap"
reused = faults_per_block()
allocator.use("default")
print(mapped, reused, faults_per_block())
"""


def test_heap_mode_reuses_a_freed_blocks_pages_and_default_mode_maps_them_again():
    # in a process of its own: what earlier tests of this worker allocated and freed is not in its heap
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    mapped, reused, again = map(float, done.stdout.split())
    huge_pages = (48 << 20) >> 21  # a fresh mapping faults in every page: 4 KiB ones, or 2 MiB huge ones
    assert mapped >= huge_pages and again >= huge_pages
    assert reused < mapped / 10


def test_bad_modes_are_refused_and_change_nothing():
    with pytest.raises(PolyampError, match=r"'mmap' unknown; accepted: default, heap"):
        allocator.use("mmap")
    assert allocator.current() == "default"
