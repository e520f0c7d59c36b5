"""glibc malloc's modes for large blocks, switched in a running process (``mallopt``).

By default glibc serves every block above its mmap threshold (at most 32 MiB; 128 KiB at first) with a
fresh ``mmap`` and returns it with ``munmap`` when freed, so a training step that allocates the same
large buffers every step (weight casts, gradients, activations) pays a page fault for every 4 KiB page
of them, every step. ``heap`` mode serves every block from the heap (``M_MMAP_MAX = 0``) and keeps what
is freed there (``M_TRIM_THRESHOLD`` 2 GiB), so the next step reuses the
same pages; the process keeps its peak heap resident. The same setting from the shell, read at start:
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296``.

``default`` mode sets ``M_MMAP_MAX`` back to glibc's 65536 and the trim threshold to 64 MiB, twice the
32 MiB mmap threshold glibc's own rule reaches once blocks of 32 MiB and more have been freed (any
``mallopt`` call stops that rule from moving the threshold further), and returns the heap's free pages
to the system (``malloc_trim``), so that large blocks are mapped afresh again rather than served from
what heap mode kept. It serves frameworks that
allocate tensors with ``malloc`` (PyTorch on CPU); TensorFlow, XLA (JAX) and MXNet use allocators of
their own. Only glibc on Linux has these options: elsewhere ``available()`` is False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from functools import cache

from ..errors import PolyampError

MODES = ("default", "heap")
SHELL = "GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_SETTINGS = {"default": ((_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 64 << 20)),
             "heap": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))}  # fmt: skip
_state = {"mode": "default"}


@cache
def _libc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def available() -> bool:
    """Whether this process runs on glibc, whose ``mallopt`` takes these modes."""
    return _libc() is not None


def current() -> str:
    """The mode ``use`` last set in this process (``default`` before any)."""
    return _state["mode"]


def use(mode: str) -> None:
    """Switch this process's allocator to ``mode`` (``default`` or ``heap``; module docstring)."""
    if mode not in MODES:
        raise PolyampError(f"allocator mode {mode!r} unknown; accepted: {', '.join(MODES)}")
    libc = _libc()
    if libc is None:
        raise PolyampError(f"the allocator modes need glibc's mallopt; this process runs on "
                           f"{platform.system()} {platform.libc_ver()[0] or 'without glibc'}")  # fmt: skip
    for option, value in _SETTINGS[mode]:
        if libc.mallopt(option, value) != 1:
            raise PolyampError(f"mallopt({option}, {value}) failed")
    if mode == "default":
        libc.malloc_trim(0)
    _state["mode"] = mode
