"""glibc malloc's two modes for large blocks: a process setting, and ``mallopt`` to switch it in-process.

By default glibc serves every block above its mmap threshold (at most 32 MiB; 128 KiB at first) with a
fresh ``mmap`` and returns it with ``munmap`` when freed, so a training step that allocates the same
large buffers every step (weight casts, gradients, activations) pays a page fault for every 4 KiB page
of them, every step. ``heap`` mode serves every block from the heap (``M_MMAP_MAX = 0``) and keeps what
is freed there (``M_TRIM_THRESHOLD`` 2 GiB), so the next step reuses the same pages; the process keeps
its peak heap resident. For a whole process it is ``ENV``, read at start (``SHELL``: as a shell
prefix); ``use("heap")`` sets it in a running one. Heap mode reaches what is allocated with ``malloc``
(PyTorch's CPU tensors); TensorFlow, XLA (JAX) and MXNet have allocators of their own.

It is not a tune knob: configurations stepped in alternation in one process share its heap
(docs/tune.md); ``polyamp compare --tuned`` measures it in processes of its own. ``default`` mode sets
``M_MMAP_MAX`` back to glibc's 65536 and the trim threshold to 64 MiB, twice the 32 MiB mmap threshold
glibc's own rule reaches once blocks of 32 MiB and more have been freed (any ``mallopt`` call stops
that rule), and returns the heap's free pages to the system (``malloc_trim``), so that large blocks are
mapped afresh again. Only glibc on Linux has these options: elsewhere ``available()`` is False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from functools import cache

from ..errors import PolyampError

MODES = ("default", "heap")
ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"}  # heap mode
SHELL = "GLIBC_TUNABLES=" + ENV["GLIBC_TUNABLES"]
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_SETTINGS = {"default": ((_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 64 << 20)),
             "heap": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))}  # fmt: skip
_state = {"mode": "heap" if "malloc.mmap_max=0" in os.environ.get("GLIBC_TUNABLES", "") else "default"}


@cache
def _libc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def available() -> bool:
    """Whether this process runs on glibc, whose ``mallopt`` takes these modes."""
    return _libc() is not None


def current() -> str:
    """The mode ``use`` last set in this process; before any, ``heap`` where the process started with
    ``GLIBC_TUNABLES`` holding ``malloc.mmap_max=0``, else ``default``."""
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
