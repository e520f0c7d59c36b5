"""The doctor's PyTorch binning: ``histogram(t)`` and ``ratio_histogram(u, w)`` on the tensor's device.

Binning (``histogram``) happens on the tensor's device; only the 4096 key counts and a few scalars reach
the host. A float32 (fp16, bf16 and fp8 are widened exactly) is read as int32 bits: ``a = bits & 0x7fffffff``
orders magnitudes as integers, and for a normal float the key ``a >> 19`` is ``SUB * biased exponent + k``,
the spec's index less a constant; one ``bincount`` counts the keys and ``aminmax(a)`` gives the extremes.
Key 0 holds zeros (and subnormals below 2^-130, which ``count_nonzero`` then tells apart), keys below 16
subnormals (re-binned from ``float(a)``), the top keys inf/NaN; with zeros or inf/NaN present the extremes
are those of ``(a - 1) mod 2^31`` and ``(a - 0x7f800000) mod 2^31``, reduced per row first so that only the
rows holding a zero or inf/NaN are shifted (``_extreme``). A large CPU tensor is binned from the high int16
halves of its magnitudes (one strided op, half the bytes), counted in 2^15 bins (8 lanes per key) by one
``bincount`` per chunk on torch's threads at once (``bincount`` runs on one thread and releases the GIL);
with no inf, NaN or subnormal, ``aminmax`` of the floats gives the largest magnitude and the rows whose
least key is 0 or the lowest other key hold the zeros and the smallest (``_hist_large``), else ``a`` is
formed as above. An update ratio
``|u| / 2^b(w)`` of normal ``u``, ``w`` is the float whose bits are ``d + 0x3f800000``, ``d = a(u) -
(bits(w) & 0x7f800000)``: ``aminmax(d)`` gives its extremes. The elements with a zero, subnormal or
non-finite u or w (read from the weight's histogram) or a ratio outside float32's normal range are
located, by rows first (``_locate``), replaced in d by a regular element and binned in float64 with
``torch.frexp``, as float64 tensors are. Results equal ``LogHistogram.of(t.cpu().numpy())``
(``update_ratio_histogram``) exactly; each is checked once per layer and kind (``merged``). A large
float32 CPU tensor goes to the compiled kernel instead when numba is there (``doctor/_bin_kernel.py``,
one pass where it lies); a tensor on an accelerator is binned there and read back with all the others
at the end (``binning_device.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from ..doctor import binning as core
from ..doctor import vector
from ..doctor.histogram import B_MIN, N_BINS, SUB, LogHistogram
from ..errors import PolyampError
from . import binning_device as on_device

_MASK, _INF, _NORMAL, _ONE = core.F32.mask, core.F32.inf, core.F32.normal, 0x3F800000
_SHIFT, _OFFSET = core.F32.shift, core.F32.offset  # a >> _SHIFT = SUB * biased exponent + k; index - that
_KEYS, _KEY_INF = core.F32.keys, _INF >> _SHIFT
_LANES = 1 << (_SHIFT - 16)  # high int16 halves per key
_HIGH = int(sys.byteorder == "little")  # the high int16 half of an int32 in memory (GPUs: little-endian)
_LARGE = 1 << 20  # from this many elements on, a CPU tensor's keys are int16 (``_large``)
_SPLIT = 1 << 21  # the fewest keys worth a thread of their own (fewer run slower split, on this CPU)
_ROW = 1 << 12  # elements per row when looking for a few elements (``_locate``, ``_extreme``, ``_lowest``)
_TINY = float(np.finfo(np.float32).tiny)
_COMPILED_MIN = 1 << 15  # from this many elements on, a float32 CPU tensor goes to the compiled kernel


class Scratch:
    """Flat work buffers kept for one ``collect``, one per slot and device, grown as needed (the first
    write to fresh memory costs its page faults: on this project's CPU 2-3x the op itself in numpy memory,
    6x in torch's, benchmarks/host_copy_torch.py; CPU buffers are numpy's), and the threads that share
    a ``bincount``."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, slot: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._bufs.get((slot, device))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = (torch.from_numpy(np.empty(n, torch.empty(0, dtype=dtype).numpy().dtype))
                   if device.type == "cpu" else torch.empty(n, dtype=dtype, device=device))  # fmt: skip
            self._bufs[slot, device] = buf
        return buf[:n]

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(torch.get_num_threads() - 1, 1))
        return self._pool

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._bufs.clear()


def _scratch(scratch: Scratch | None):
    """``scratch``, or a new one for this call only."""
    return contextlib.nullcontext(scratch) if scratch is not None else Scratch()


def histogram(t: torch.Tensor, scratch: Scratch | None = None) -> LogHistogram:
    """The ``LogHistogram`` of a floating tensor, binned on its device (module docstring)."""
    return merged([binned(t, scratch)])


def ratio_histogram(update: torch.Tensor, weight: torch.Tensor, scratch: Scratch | None = None):
    """``update_ratio_histogram(update, weight)`` of the core, binned on the tensors' device."""
    return merged([ratio_binned(update, weight, scratch)])


def binned(t: torch.Tensor, scratch: Scratch | None) -> Part:
    """``t``'s histogram: a large CPU tensor from its high halves (``_hist_large``) when that suffices,
    else from its magnitudes' bits (``_hist_bits``)."""
    x = t.detach().reshape(-1)
    if x.dtype == torch.float64:
        return _ratio64(x, None)
    if not _narrow(x.dtype):
        raise PolyampError(f"cannot bin a {x.dtype} tensor; accepted: floating-point dtypes (real)")
    if on_device.on_accelerator(x):
        return on_device.values(x.float()) if x.numel() else _empty()
    kernel = _compiled(x)
    if kernel is not None:
        return _from_vector(kernel.values(x.float().numpy()), ratio=False)
    with _scratch(scratch) as scratch:
        x = x.float()
        keys = None
        if _large(x):
            part, keys = _hist_large(x, scratch)
            if part is not None:
                return part
        a = scratch("a", x.numel(), torch.int32, x.device)
        return _hist_bits(torch.bitwise_and(x.view(torch.int32), _MASK, out=a), scratch, keys)


def ratio_binned(update: torch.Tensor, weight: torch.Tensor, scratch: Scratch | None) -> Part:
    u, w = update.detach().reshape(-1), weight.detach().reshape(-1)
    if u.shape != w.shape:
        raise PolyampError(f"update shape {tuple(update.shape)} differs from weight's {tuple(weight.shape)}")
    if not (_narrow(u.dtype) and _narrow(w.dtype)):
        return _ratio64(u.double(), w.double())
    if not u.numel():
        return _empty()
    if on_device.on_accelerator(u):
        return on_device.ratio(u.float(), w.float())
    with _scratch(scratch) as scratch:
        u, w = u.float(), w.float()
        au = torch.bitwise_and(u.view(torch.int32), _MASK, out=scratch("u", u.numel(), torch.int32, u.device))
        e = torch.bitwise_and(w.view(torch.int32), _INF, out=scratch("a", w.numel(), torch.int32, w.device))
        return ratio_bits(au, e, w, scratch)


def binned_many(tensors: list[torch.Tensor], scratch: Scratch | None) -> list:
    """``binned`` of each tensor; the small ones on an accelerator (``binning_device.batched``, float32 or
    narrower) in one batch per device (``binning_device.values_many``: ``Pending``, read by ``settle``)."""
    out: list = [None] * len(tensors)
    batches: dict = {}
    for i, t in enumerate(tensors):
        if on_device.batched(t) and _narrow(t.dtype):
            batches.setdefault(t.device, []).append(i)
        else:
            out[i] = binned(t, scratch)
    for idx in batches.values():
        for i, part in zip(idx, on_device.values_many([tensors[i].detach() for i in idx])):
            out[i] = part
    return out


def updates_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """For each ``(after, before)``: the histograms of ``before`` and of the update ratio of ``after -
    before`` (the update in their dtype), batched per device for small tensors on an accelerator
    (``binning_device.batched``, one float32-or-narrower dtype); None for the others."""
    out: list = [None] * len(pairs)
    batches: dict = {}
    for i, (p, w) in enumerate(pairs):
        if on_device.batched(w) and _narrow(w.dtype) and p.dtype == w.dtype:
            batches.setdefault(w.device, []).append(i)
    for idx in batches.values():
        ws = [pairs[i][1].detach() for i in idx]
        us = [pairs[i][0].detach() - w for i, w in zip(idx, ws)]
        for i, weight, ratio in zip(idx, on_device.values_many(ws), on_device.ratio_many(us, ws)):
            out[i] = (weight, ratio)
    return out


def weight_and_ratio(after: torch.Tensor, before: torch.Tensor) -> tuple[Part, Part] | None:
    """The histograms of ``before`` and of the update ratio of ``after - before``: float32 CPU tensors of
    one shape in one pass of the compiled kernel, tensors on an accelerator there (``Pending``); None
    where neither applies (no numba, another dtype, a small tensor)."""
    w, p = before.detach().reshape(-1), after.detach().reshape(-1)
    if on_device.on_accelerator(w) and _narrow(w.dtype) and p.dtype == w.dtype:
        if not w.numel():
            return _empty(), _empty()
        return on_device.values(w.float()), on_device.ratio((p - w).float(), w.float())
    kernel = _compiled(w)
    if kernel is None or w.dtype != torch.float32 or p.dtype != torch.float32 or p.shape != w.shape:
        return None
    weight, ratio = kernel.weight_and_ratio(w.numpy(), p.numpy())
    return _from_vector(weight, ratio=False), _from_vector(ratio, ratio=True)


@lru_cache(maxsize=1)
def _kernel_module():
    """``doctor/_bin_kernel.py``, or None when numba is absent or POLYAMP_NO_NUMBA is set."""
    if os.environ.get("POLYAMP_NO_NUMBA"):
        return None
    try:
        from ..doctor import _bin_kernel
    except ImportError:
        return None
    return _bin_kernel


def _compiled(x: torch.Tensor):
    """The compiled kernels' module for the flat tensor ``x``: a contiguous CPU tensor of at least
    ``_COMPILED_MIN`` elements that float32 holds; else None."""
    if x.device.type != "cpu" or x.numel() < _COMPILED_MIN or not x.is_contiguous():
        return None
    return _kernel_module()


def _from_vector(v: np.ndarray, ratio: bool) -> Part:
    """A binning vector (``doctor/vector.py``) as a Part."""
    return Part(**vector.fields(v, ratio))


def settle(parts: list) -> list[Part]:
    """``parts`` with every ``Pending`` (``binning_device.py``) read back: one transfer per device."""
    pending = [p for p in parts if isinstance(p, on_device.Pending)]
    if not pending:
        return parts
    done = {id(p): _from_vector(row, p.ratio) for p, row in zip(pending, on_device.fetch(pending))}
    return [done.get(id(p), p) for p in parts]


class Part(NamedTuple):
    """One tensor's binning: ``LogHistogram``'s fields, checked once per layer and kind (``merged``)."""

    counts: np.ndarray
    zeros: int = 0
    nonfinite: int = 0
    amax: float = 0.0
    amin_nonzero: float | None = None
    apart: int = 0


def _combined(parts: list[Part]) -> Part:
    mins = [p.amin_nonzero for p in parts if p.amin_nonzero is not None]
    return Part(
        sum(p.counts for p in parts),
        sum(p.zeros for p in parts),
        sum(p.nonfinite for p in parts),
        max(p.amax for p in parts),
        min(mins) if mins else None,
        sum(p.apart for p in parts),
    )


def merged(parts: list) -> LogHistogram:
    part = _combined(settle(parts))
    return LogHistogram.from_counts(part.counts, part.zeros, part.nonfinite, part.amax, part.amin_nonzero,
                                    apart=part.apart)  # fmt: skip


def _narrow(dtype: torch.dtype) -> bool:
    """float32 and the narrower floats (fp16, bf16, fp8), which float32 holds exactly."""
    return dtype.is_floating_point and dtype.itemsize <= 4


def _large(v: torch.Tensor) -> bool:
    """Worth int16 keys counted in lanes: a contiguous CPU tensor of ``_LARGE`` elements or more."""
    return v.device.type == "cpu" and v.numel() >= _LARGE and v.is_contiguous()


def _hist_large(x: torch.Tensor, scratch: Scratch) -> tuple[Part | None, np.ndarray]:
    """The histogram of the large flat float32 CPU tensor ``x`` without its magnitudes' bits, and its key
    counts; None for the histogram when it needs them (an inf, NaN or subnormal, or many rows to search).
    The keys are the high int16 halves of the magnitudes (``bits >> 16 & 0x7fff``: one strided op, half
    the bytes), counted in lanes (``_lane_counts``); ``aminmax(x)`` gives the largest magnitude; zeros and
    the smallest magnitude are in the rows whose least key is 0 or the lowest non-zero key (``_lowest``)."""
    n = x.numel()
    k = torch.bitwise_and(x.view(torch.int16)[_HIGH::2], 0x7FFF, out=scratch("k", n, torch.int16, x.device))
    lanes = _lane_counts(k, scratch)
    lowest = lanes[1:].ne(0).to(torch.uint8).argmax() + 1  # the lowest non-zero 16-bit key present
    ends = torch.stack(torch.aminmax(x)).view(torch.int32).long()
    host = torch.cat([lanes.view(_KEYS, _LANES).sum(1), ends, torch.stack([lanes[0], lowest])]).numpy()
    keys, (lo, hi, zero, lowest) = host[:_KEYS], host[_KEYS:].tolist()
    if keys[_KEY_INF:].any() or lowest < _NORMAL >> 16:  # inf/NaN or a subnormal (or nothing but zeros)
        return None, keys
    found = _lowest(x, k, lowest, zero > 0)
    if found is None:
        return None, keys
    zeros, amin = found
    return Part(
        core.normal_counts(keys), zeros, 0, max(-core.float_of(lo), core.float_of(hi)), core.float_of(amin)
    ), keys


def _lowest(x: torch.Tensor, k: torch.Tensor, lowest: int, zero: bool) -> tuple[int, int] | None:
    """The number of zeros and the least non-zero magnitude's bits of ``x``, whose keys ``k`` are 0 (a
    zero, ``zero`` if any, or a subnormal below 2^-133) or at least ``lowest``: all are in the rows of
    ``_ROW`` whose least key is 0 or ``lowest``, or in the tail; None when such rows are many or hold a
    subnormal."""
    rows = x.numel() // _ROW
    least = k[: rows * _ROW].view(rows, _ROW).amin(1)
    hit = ((least == lowest) | (least == 0) if zero else least == lowest).nonzero().squeeze(1)
    if hit.numel() * 8 > rows:
        return None
    found = torch.cat([x[: rows * _ROW].view(rows, _ROW)[hit].reshape(-1), x[rows * _ROW :]])
    bits = found.view(torch.int32) & _MASK
    if zero and bool(((bits > 0) & (bits < 1 << 16)).any()):
        return None
    return int((bits == 0).sum()), int(bits[bits != 0].min())


def _hist_bits(a: torch.Tensor, scratch: Scratch, keys: np.ndarray | None = None) -> Part:
    """The histogram of the float32 magnitudes whose bits are ``a`` (flat contiguous int32 >= 0); ``keys``:
    the counts of ``a >> _SHIFT``, if known."""
    n = a.numel()
    if not n:
        return _empty()
    if keys is None:
        keys, lo, hi = _fetch(_keys(a, scratch), *torch.aminmax(a))
    else:
        lo, hi = torch.stack(torch.aminmax(a)).tolist()
    if hi >= _INF:  # inf/NaN present: the largest finite magnitude (negative: none)
        hi = _extreme(a, highest=True)
    zeros = 0
    if lo == 0:  # zeros present: the smallest non-zero magnitude (2^31: none); key 0 holds zeros
        lo = _extreme(a, highest=False)
        zeros = int(keys[0]) if lo >> _SHIFT else n - int(torch.count_nonzero(a))
    counts = core.normal_counts(keys)
    if 0 < lo < _NORMAL:  # subnormals: a * 2^-149 with a < 2^23, exactly float(a) * 2^-149
        sub = a[(a > 0) & (a < _NORMAL)].float().view(torch.int32)
        idx = (sub >> _SHIFT) + (_OFFSET - SUB * 149)
        counts += torch.bincount(idx.clamp(0, N_BINS - 1), minlength=N_BINS).cpu().numpy()
    return Part(
        counts,
        zeros=zeros,
        nonfinite=int(keys[_KEY_INF:].sum()),
        amax=core.float_of(hi) if hi > 0 else 0.0,
        amin_nonzero=core.float_of(lo) if 0 < lo < _INF else None,
    )


def ratio_bits(au: torch.Tensor, e: torch.Tensor, w: torch.Tensor, scratch: Scratch,
                weight: Part | None = None) -> Part:  # fmt: skip
    """``ratio_histogram`` of the update whose magnitudes' bits are ``au`` (flat contiguous int32 >= 0, not
    empty) and the flat float32 weight ``w``, whose exponent bits ``bits(w) & 0x7f800000`` are ``e`` (flat
    contiguous int32, overwritten); ``weight``: ``w``'s histogram, if known.

    ``d = au - e`` is the ratio's bits less ``_ONE`` when u, w and the ratio are normal. Elements with a
    zero, subnormal, inf or NaN u or w, or a ratio outside float32's normal range, are located
    (``_locate``) and take the float64 path; in d they are replaced by a regular element's d, whose bin
    then gives them back.
    """
    n = au.numel()
    ulo, uhi = torch.stack(torch.aminmax(au)).tolist()
    if uhi == 0 and weight is not None:  # no update at all (a frozen or lost layer): no ratio to bin
        finite_nonzero = int(weight.counts.sum())
        return Part(np.zeros(N_BINS, np.int64), finite_nonzero, weight.nonfinite, apart=weight.zeros)
    special = [_locate(au, ulo, uhi)]
    if weight is None or weight.zeros or weight.nonfinite or (weight.amin_nonzero or 0) < _TINY:
        special.append(_locate(e, *torch.stack(torch.aminmax(e)).tolist()))
    d = torch.sub(au, e, out=e)
    while True:  # at most twice: the regular elements' ratios may leave the normal range too
        special = [i for i in special if i.numel()]
        idx = torch.cat(special).unique() if special else au.new_empty(0, dtype=torch.long)
        if idx.numel() == n:
            return _ratio64(au.view(torch.float32).double(), w.double())
        if idx.numel():
            gaps = idx != torch.arange(idx.numel(), device=idx.device)  # the first index not special
            fill = int(d[int(gaps.to(torch.uint8).argmax()) if bool(gaps.any()) else idx.numel()])
            d.index_fill_(0, idx, fill)
        lo, hi = (v + _ONE for v in torch.stack(torch.aminmax(d)).tolist())
        if _NORMAL <= lo and hi < _INF:
            break
        special.append(_locate(d, lo, hi, _ONE))
    keys = _keys(d, scratch, _ONE).cpu().numpy()  # every element regular now: d + _ONE is the ratio's bits
    counts = core.normal_counts(keys)
    if not idx.numel():
        return Part(counts, amax=core.float_of(hi), amin_nonzero=core.float_of(lo))
    counts[min(((fill + _ONE) >> _SHIFT) + _OFFSET, N_BINS - 1)] -= idx.numel()
    regular = Part(counts, amax=core.float_of(hi), amin_nonzero=core.float_of(lo))
    return _combined([regular, _ratio64(au[idx].view(torch.float32).double(), w[idx].double())])


def _extreme(a: torch.Tensor, highest: bool) -> int:
    """The largest finite (``highest``) or the smallest non-zero of the bits ``a`` (flat contiguous int32
    >= 0), as the reduction of ``(a - 0x7f800000) mod 2^31`` (``(a - 1) mod 2^31``), which puts inf/NaN
    (zeros) past all others: per row of ``_ROW`` first; only the rows holding one, and the tail, are
    shifted, when they are few; else all of ``a``, in place and back."""
    shift, reduce = (-_INF, torch.amax) if highest else (-1, torch.amin)
    unshift = (lambda v: v - _NORMAL) if highest else (lambda v: v + 1)
    rows = a.numel() // _ROW
    body = a[: rows * _ROW].view(rows, _ROW)
    per_row = reduce(body, 1)
    hit = (per_row >= _INF if highest else per_row == 0).nonzero().squeeze(1)
    if hit.numel() * 8 > rows:
        value = int(reduce(a.add_(shift).bitwise_and_(_MASK)))
        a.sub_(shift + _MASK + 1).bitwise_and_(_MASK)
        return unshift(value)
    rest = torch.cat([body[hit].reshape(-1), a[rows * _ROW :]])
    values = [unshift(int(reduce(torch.bitwise_and(rest + shift, _MASK))))] if rest.numel() else []
    if hit.numel() < rows:
        values.append(int(reduce(per_row[per_row < _INF if highest else per_row > 0])))
    return max(values) if highest else min(values)


def _locate(v: torch.Tensor, lo: int, hi: int, less: int = 0) -> torch.Tensor:
    """The indices (ascending) where the bits ``v + less`` (flat int32, with extremes lo, hi) are not those
    of a normal float. Rows of ``_ROW`` elements whose minimum and maximum are normal hold none: when the
    other rows are few, only they are searched (a reduction instead of a full mask and ``nonzero``)."""
    low, high = (_NORMAL - less if lo < _NORMAL else None), (_INF - less if hi >= _INF else None)
    if low is None and high is None:
        return v.new_empty(0, dtype=torch.long)

    def outside(x: torch.Tensor, by_row: bool = False) -> torch.Tensor:  # elements, or rows that hold one
        below = None if low is None else (x.amin(1) if by_row else x) < low
        above = None if high is None else (x.amax(1) if by_row else x) >= high
        return above if below is None else below if above is None else below | above

    rows = v.numel() // _ROW
    body = v[: rows * _ROW].view(rows, _ROW)
    hit = outside(body, by_row=True).nonzero().squeeze(1)
    if hit.numel() * 8 > rows:  # many: one mask over everything
        return outside(v).nonzero().squeeze(1)
    found = outside(body[hit]).nonzero()  # (row among those hit, column)
    tail = outside(v[rows * _ROW :]).nonzero().squeeze(1) + rows * _ROW
    return torch.cat([hit[found[:, 0]] * _ROW + found[:, 1], tail])


def _keys(v: torch.Tensor, scratch: Scratch, add: int = 0) -> torch.Tensor:
    """The counts (on the device) of the keys ``(v + add) >> _SHIFT`` of the flat contiguous int32 ``v``
    (``add`` a multiple of 2^16; each ``v + add`` in [0, 2^31)); of a large one, from the high int16 halves
    plus ``add >> 16``, written contiguous by one strided op (``_lane_counts``)."""
    if not _large(v):
        return torch.bincount((v + add if add else v) >> _SHIFT, minlength=_KEYS)
    high, k = v.view(torch.int16)[_HIGH::2], scratch("k", v.numel(), torch.int16, v.device)
    torch.add(high, add >> 16, out=k) if add else k.copy_(high)
    return _lane_counts(k, scratch).view(_KEYS, _LANES).sum(1)


def _lane_counts(k: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``bincount(k, minlength=2^15)`` of the int16 keys ``k`` (half the bytes of int32 keys; a key
    ``a >> _SHIFT`` is ``_LANES`` lanes of them): one ``bincount`` per chunk, the chunks on torch's threads
    at once (``bincount`` runs on one thread and releases the GIL)."""
    chunks = k.chunk(max(1, min(torch.get_num_threads(), k.numel() // _SPLIT)))
    others = [scratch.pool().submit(torch.bincount, c, minlength=_KEYS * _LANES) for c in chunks[1:]]
    counts = torch.bincount(chunks[0], minlength=_KEYS * _LANES)
    for f in others:
        counts += f.result()
    return counts


def _fetch(counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[np.ndarray, int, int]:
    """The key counts (1-D int64) as numpy and the extremes as ints, in one transfer to the host."""
    host = torch.cat([counts, torch.stack([lo, hi]).to(counts.dtype)]).cpu().numpy()
    return host[:-2], int(host[-2]), int(host[-1])


def _empty() -> Part:
    return Part(np.zeros(N_BINS, np.int64))


def _ratio64(u: torch.Tensor, w: torch.Tensor | None) -> Part:
    """float64 frexp path: the histogram of ``u`` (``w`` None) or of the update ratio ``|u| / 2^b(w)``."""
    u = u.abs()
    bad = ~torch.isfinite(u) if w is None else ~(torch.isfinite(u) & torch.isfinite(w.abs()))
    apart = torch.zeros_like(bad) if w is None else ~bad & (w == 0)
    zeros = ~bad & ~apart & (u == 0)
    sel = ~(bad | apart | zeros)
    mu, eu = torch.frexp(u[sel])
    shift = eu.long() - (1 if w is None else torch.frexp(w[sel])[1].long())  # b(u), or b(u) - b(w)
    idx = SUB * (shift - B_MIN) + torch.floor((2 * mu - 1) * SUB).long() + 1
    counts = torch.bincount(idx.clamp(0, N_BINS - 1), minlength=N_BINS)
    if w is None:
        r = u[sel]
    else:  # exact ldexp(mu, shift + 1): first into the normal range, then one rounding
        t = shift + 1
        extra = (-1022 - t).clamp(0, 1074)
        r = mu * torch.pow(2.0, (t + extra).double()) * torch.pow(2.0, (-extra).double())
        r = r.clamp(max=torch.finfo(torch.float64).max)
    empty = not r.numel()
    amax, amin, tiny = (0, 0, 1) if empty else torch.stack([r.max(), r.min(), (r == 0).any()]).tolist()
    return Part(
        counts.cpu().numpy(),
        zeros=int(zeros.sum()),
        nonfinite=int(bad.sum()),
        amax=float(amax),
        amin_nonzero=None if tiny else float(amin),
        apart=int(apart.sum()),
    )
