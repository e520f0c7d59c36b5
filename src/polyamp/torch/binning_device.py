"""The doctor's torch binning on an accelerator: every tensor binned where it is, read back once.

A tensor not in host memory is binned by elementwise ops and one ``bincount`` into the one-vector form
of ``doctor/vector.py``, left on its device (``Pending``); ``fetch`` reads all of a call's vectors in
one transfer per device (``binning.settle``). Each element's slot is the core's (``doctor/binning.py``:
its bin, or zeros, inf/NaN, zero weights); an update ratio's key is ``vector.py``'s. Exact, as
``binning.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..doctor import binning as core
from ..doctor import vector
from . import xp

_MASK, _INF = 0x7FFFFFFF, 0x7F800000
_BIG = 1 << 62  # above every ratio key


_BATCH_MAX = 1 << 20  # fewer elements than this: binned with a call's other small tensors


def on_accelerator(x: torch.Tensor) -> bool:
    """Binned where it is, read back once per ``collect``: a tensor not in host memory."""
    return x.device.type != "cpu"


def batched(x: torch.Tensor) -> bool:
    """Binned in a batch (``values_many``, ``ratio_many``): a small non-empty tensor on an accelerator.
    A large one goes alone: batched, its elements' per-tensor extremes (``scatter_reduce``) and the
    batch's ``bincount`` over many slots contend on a few memory words (on an H200 a batch of the mlp
    workload's 25M parameters cost 7-10x binning them one by one; docs/BENCHMARKS.md, "GPU run")."""
    return on_accelerator(x) and 0 < x.numel() < _BATCH_MAX


class Pending(NamedTuple):
    """A binning still on its device: its vector (``doctor/vector.py``), and whether it is of ratios."""

    vector: torch.Tensor
    ratio: bool


def fetch(pending: list[Pending]) -> list[np.ndarray]:
    """The vectors of ``pending`` on the host, in order: one transfer per device."""
    out: dict[int, np.ndarray] = {}
    for device in {p.vector.device for p in pending}:
        here = [i for i, p in enumerate(pending) if p.vector.device == device]
        rows = torch.stack([pending[i].vector for i in here]).cpu().numpy()
        out.update(zip(here, rows))
    return [out[i] for i in range(len(pending))]


def values(x: torch.Tensor) -> Pending:
    """The histogram of the flat, non-empty float32 ``x`` (``values_many`` of one tensor)."""
    return values_many([x])[0]


def ratio(u: torch.Tensor, w: torch.Tensor) -> Pending:
    """``ratio_histogram`` of the flat, non-empty float32 ``u``, ``w`` (``ratio_many`` of one pair)."""
    return ratio_many([u], [w])[0]


def values_many(xs: list[torch.Tensor]) -> list[Pending]:
    """The histograms of non-empty floating tensors of one device, with one set of kernels for all (a
    launch-bound step has many small tensors): concatenated as float32, each element's index from its
    pseudo bits plus its tensor's slot, one ``bincount``; the extremes over the finite non-zero bits."""
    flat, seg = _concat(xs)
    a = flat.view(torch.int32) & _MASK
    return _pending(core.value_slots(xp, a), a, (a < _INF) & (a > 0), seg, len(xs), ratio=False)


def ratio_many(us: list[torch.Tensor], ws: list[torch.Tensor]) -> list[Pending]:
    """``ratio_histogram`` of each pair of non-empty floating ``us``, ``ws`` (same shapes), one set of
    kernels for all: the index of ``|u|`` less ``SUB * b(w)``, clamped; non-finite u or w, then zero w
    (apart), then zero u counted apart."""
    (u, seg), (w, _) = _concat(us), _concat(ws)
    au, aw = u.view(torch.int32) & _MASK, w.view(torch.int32) & _MASK
    idx, counted, s, pu = core.ratio_parts(xp, au, aw)
    keys = (s.long() << 23) + (pu & 0x7FFFFF).long() + vector.KEY_BIAS
    return _pending(idx, keys, counted, seg, len(us), ratio=True)


def _concat(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensors flat, as one float32 tensor, and each element's tensor index (None for one tensor)."""
    if len(xs) == 1:
        return xs[0].reshape(-1).float(), None
    flat = torch.cat([x.reshape(-1).float() for x in xs])
    sizes = torch.tensor([x.numel() for x in xs], device=flat.device)
    return flat, torch.repeat_interleave(torch.arange(len(xs), device=flat.device), sizes,
                                         output_size=flat.numel())  # fmt: skip


def _pending(counts_at, keys, counted, seg, k: int, ratio: bool) -> list[Pending]:
    """The vectors of ``k`` tensors from their elements' indices ``counts_at`` (the spec's, or ZEROS /
    NONFINITE / APART) and the keys of the ``counted`` elements, ``seg`` the tensor of each (None: one)."""
    big = _INF if keys.dtype == torch.int32 else _BIG  # above every key (magnitude bits, ratio keys)
    high, low = torch.where(counted, keys, vector.NONE), torch.where(counted, keys, big)
    if seg is None:
        counts = torch.bincount(counts_at, minlength=vector.HIGH)[None]
        high, low = high.amax()[None], low.amin()[None]
    else:
        counts = torch.bincount(counts_at + seg * vector.HIGH, minlength=k * vector.HIGH).view(k, vector.HIGH)
        high = high.new_full((k,), vector.NONE).scatter_reduce_(0, seg, high, "amax")
        low = low.new_full((k,), big).scatter_reduce_(0, seg, low, "amin")
    low = torch.where(low == big, vector.NONE, low)
    rows = torch.cat([counts.long(), high.long()[:, None], low.long()[:, None]], 1)
    return [Pending(row, ratio) for row in rows]
