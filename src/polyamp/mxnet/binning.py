"""The doctor's MXNet binning: ``histogram(x)``, ``ratio_histogram(update, weight)`` and the helpers
``doctor.collect`` uses (the module docstring of ``doctor.py`` says which path runs where).
"""

from __future__ import annotations

import contextlib
import ctypes
import math

import numpy as np

from ..doctor import binning as core
from ..doctor import binning_host as host
from ..doctor.histogram import N_BINS, SUB, LogHistogram
from ..errors import PolyampError
from .keep import dtype_name
from .ops import autograd, mx

_npi = mx.nd.numpy._internal  # MXNet 1.9's numpy-interface ops: bincount, bitwise_and

_LOG_SUB = SUB.bit_length() - 1  # SUB is a power of two
_RATIO_OFFSET = core.RATIO_OFFSET  # ratio index = K(u) - SUB * E(w) + this (E biased, K = SUB*E + k)
# a prototype of our own: setting argtypes on ctypes.pythonapi's shared function object would change it
# for MXNet's DLPack deleter too (it passes the capsule as a void pointer)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_MANAGED = ctypes.POINTER(mx.nd.ndarray.DLManagedTensor)
_HOST_DEVICES = frozenset({"cpu", "cpu_pinned", "cpu_shared"})  # contexts whose arrays are host memory


_Spec = core.Width
_F32, _F64 = core.F32, core.F64


def _host_array(size: int, dtype, lane: int, zeros: bool = False) -> np.ndarray:
    """A flat numpy array of ``size`` elements (``zeros``: zero-filled) whose address lies ``lane``
    KiB past a 4 KiB boundary (lanes 0-3). Arrays one kernel streams together (a weight, its gradient
    and its optimizer states) go in different lanes: loads stall behind stores to addresses equal in
    their low 12 bits (4K aliasing; MXNet's Adam ran about twice as slow on numpy's large arrays, all
    16 bytes past a boundary)."""
    itemsize = np.dtype(dtype).itemsize
    buf = np.empty(size + 4096 // itemsize, dtype)  # np.zeros's calloc would fault in 4 KiB pages
    start = ((lane % 4 * 1024 - buf.ctypes.data) % 4096) // itemsize
    out = buf[start : start + size]
    if zeros:
        out.fill(0)
    return out


# -- binning in MXNet -----------------------------------------------------------------------------
_WIDTHS = {"float16": _F32, "bfloat16": _F32, "float32": _F32, "float64": _F64}
_NAN_BITS = 0x7FC00000  # a float32 NaN: quantize_v2's min and max skip it, its key is a non-finite one


class _Scratch:
    """Work buffers kept for one ``collect``: MXNet's, flat (by slot, dtype and context; MXNet writes
    into an existing NDArray several times faster than into a fresh one, whose pages fault in on
    CPU), and numpy's (a chunk each, ``host``; ``magnitudes``)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, mx.nd.NDArray] = {}

    def __call__(self, slot: str, like, dtype: str):
        key = (slot, dtype, like.context)
        buf = self._bufs.get(key)
        if buf is None or buf.size < like.size:
            buf = self._bufs[key] = mx.nd.empty((like.size,), ctx=like.context, dtype=dtype)
        return buf if buf.size == like.size else buf[: like.size]

    def nans(self, like):
        """int32 NaN bits, as many as ``like`` has elements (never written but here)."""
        key = ("nan", "int32", like.context)
        if key not in self._bufs or self._bufs[key].size < like.size:
            self._bufs[key] = mx.nd.full((like.size,), _NAN_BITS, ctx=like.context, dtype="int32")
        buf = self._bufs[key]
        return buf if buf.size == like.size else buf[: like.size]

    def magnitudes(self, x) -> np.ndarray:
        """``|x|`` (float32 on ``mx.cpu()``), written by MXNet in the default layout into numpy memory
        kept for the call, as flat int32 bits."""
        buf = self._bufs.get("magnitudes")
        if buf is None or buf.size < x.size:
            buf = self._bufs["magnitudes"] = _host_array(x.size, np.float32, lane=1)
        flat = buf[: x.size]
        with autograd.pause():
            mx.nd.abs(x, out=mx.nd.from_numpy(flat.reshape(x.shape), zero_copy=True)).wait_to_read()
        return flat.view(np.int32)

    def host(self, slot: str, dtype, size: int) -> np.ndarray:
        """A numpy work buffer of ``size`` (at most ``binning_host.CHUNK``) elements, each slot in a lane
        of its own."""
        key = ("host", slot, np.dtype(dtype))
        if key not in self._bufs:
            self._bufs[key] = _host_array(host.CHUNK, dtype, lane=len(self._bufs))
        return self._bufs[key][:size]


def _spec(dtype) -> _Spec:
    name = dtype_name(dtype)
    if name not in _WIDTHS:
        raise PolyampError(f"cannot bin a {name} NDArray; accepted: {', '.join(_WIDTHS)}")
    return _WIDTHS[name]


def _flat(x, spec: _Spec):
    x = x.reshape((-1,))
    return x if dtype_name(x.dtype) == _dtype(spec) else x.astype(_dtype(spec))


def histogram(x, scratch: _Scratch | None = None) -> LogHistogram:
    """The ``LogHistogram`` of a floating NDArray: by numpy on a view of host memory, else by MXNet on
    its context (module docstring)."""
    spec = _spec(x.dtype)
    if not x.size:
        return _empty()
    scratch = scratch or _Scratch()
    name = dtype_name(x.dtype)
    if name in _HOST_BITS:
        with _host_view(x, _HOST_BITS[name]) as view:
            if view is not None:
                return host.histogram(view, name, scratch.host)
        if name == "float32" and _in_numpy(x):  # a layout without a view: MKL-DNN's
            return host.histogram(scratch.magnitudes(x), name, scratch.host)
    with autograd.pause():
        x = _flat(x, spec)
        if spec is not _F32:
            return _hist(mx.nd.abs(x), spec, None)
        return _hist(mx.nd.abs(x, out=scratch("a", x, "float32")), spec, scratch)


def ratio_histogram(update, weight) -> LogHistogram:
    """``update_ratio_histogram(update, weight)`` of the core, binned by MXNet (in float64)."""
    if tuple(update.shape) != tuple(weight.shape):
        raise PolyampError(f"update shape {tuple(update.shape)} differs from weight's {tuple(weight.shape)}")
    spec = max(_spec(update.dtype), _spec(weight.dtype), key=lambda s: s.mant)
    if not update.size:
        return _empty()
    with autograd.pause():
        return _ratio64(mx.nd.abs(_flat(update, spec)), _flat(weight, spec))


def _bits(a, code: int = 0):
    """An NDArray's memory viewed as another type of the same width (no copy): its DLPack capsule with
    the type code set to ``code`` (0 int, the default; 2 float)."""
    capsule = mx.nd.to_dlpack_for_read(a)
    tensor = ctypes.cast(_capsule_pointer(capsule, b"dltensor"), _MANAGED).contents
    tensor.dl_tensor.dtype.type_code = code
    return mx.nd.from_dlpack(capsule)


# -- binning in numpy, on host memory -------------------------------------------------------------
_HOST_BITS = {"float32": np.int32, "float16": np.float16, "bfloat16": np.uint16}  # the view binned


@contextlib.contextmanager
def _host_view(x, dtype):
    """``x``'s memory as a flat read-only numpy array of ``dtype`` (no copy), valid inside the ``with``
    block only (the DLPack capsule held meanwhile keeps the memory alive), read after MXNet's pending
    writes to ``x``; None where it is not host memory in the default storage and layout (another
    context; MKL-DNN's blocked layouts, which have no DLPack view)."""
    if not x.size or x.stype != "default" or x.context.device_type not in _HOST_DEVICES:
        yield None
        return
    try:
        capsule = mx.nd.to_dlpack_for_read(x)  # waits for the pending writes
    except mx.base.MXNetError:
        yield None
        return
    tensor = ctypes.cast(_capsule_pointer(capsule, b"dltensor"), _MANAGED).contents.dl_tensor
    memory = (ctypes.c_char * (x.size * np.dtype(x.dtype).itemsize)).from_address(
        tensor.data + tensor.byte_offset
    )
    view = np.frombuffer(memory, dtype)
    view.flags.writeable = False
    yield view


def _in_numpy(x) -> bool:
    """Whether ``x``'s copies and work arrays may lie in numpy memory: a default-storage array of a
    dtype numpy knows, on ``mx.cpu()`` (where ``from_numpy`` makes its arrays)."""
    return (x.stype == "default" and x.context == mx.cpu() and x.context.device_type in _HOST_DEVICES
            and np.dtype(x.dtype).names is None)  # fmt: skip


def _host_update(weight, before, before_hist: LogHistogram, scratch: _Scratch):
    """``_update``'s float32 fast path on host memory (``binning_host.update``; ``before``: the weight's
    values before the step, an NDArray or a flat numpy array), or None where it does not apply (the
    caller goes on)."""
    if not host.update_fits(before_hist):
        return None
    with _host_view(weight, np.float32) as after, _host_values(before) as before:
        if after is None or before is None:
            return None
        return host.update(after, before, before_hist, scratch.host)


@contextlib.contextmanager
def _host_values(x):
    """A flat float32 numpy ``x`` as it is, an NDArray's ``_host_view``."""
    if isinstance(x, np.ndarray):
        yield x.reshape(-1)
    else:
        with _host_view(x, np.float32) as view:
            yield view


def _keys(ia, spec: _Spec) -> np.ndarray:
    """The counts of the keys ``ia >> spec.shift`` of the non-negative ints ``ia``."""
    if spec is _F32:  # one op: MXNet's histogram bins ints over [0, 2^31) in double, exactly
        counts = mx.nd.histogram(ia, bins=spec.keys, range=(0, 2.0**31))[0]
    else:
        counts = _npi.bincount((ia / (1 << spec.shift)).as_np_ndarray(), minlength=spec.keys)
    return counts.asnumpy().astype(np.int64)


def _min_max(a, scratch: _Scratch):
    """(min, max) of the float32 ``a``, NaN skipped, as shape (1,) NDArrays, in one pass: contrib's
    ``quantize_v2`` reports them when given no calibration range. Where it does not skip NaN (a
    build without MKL-DNN), they come back NaN and the caller takes its general path."""
    lo, hi = mx.nd.empty((1,), ctx=a.context), mx.nd.empty((1,), ctx=a.context)
    mx.nd.contrib.quantize_v2(a, out_type="uint8", out=[scratch("q", a, "uint8"), lo, hi])
    return lo, hi


def _host(*arrays) -> list:
    """Scalars (shape (1,) NDArrays, all float or all int) to the host in one read."""
    if len({a.dtype for a in arrays}) > 1:
        arrays = tuple(a.astype("int64") for a in arrays)
    return mx.nd.concat(*arrays, dim=0).asnumpy().tolist()


def _dtype(spec: _Spec) -> str:
    return f"float{spec.bits}"


def _float(bits: int, spec: _Spec) -> float:
    return core.float_of(bits, spec)


def _empty(zeros: int = 0) -> LogHistogram:
    return LogHistogram.from_counts(np.zeros(N_BINS, np.int64), zeros, 0, 0.0)


def _hist(a, spec: _Spec, scratch: _Scratch | None) -> LogHistogram:
    """The histogram of the magnitudes ``a`` (a flat float NDArray of ``spec``'s width, ours to change;
    float32 ones with ``scratch``)."""
    ia = _bits(a)
    keys = _keys(ia, spec)
    top = spec.inf >> spec.shift
    low, nonfinite = int(keys[:SUB].sum()), int(keys[top:].sum())  # zeros and subnormals; inf and NaN
    if spec is _F32 and not nonfinite:  # zeros (if any) as NaN: min and max skip them
        nonzero = mx.nd.where(ia, ia, scratch.nans(ia), out=scratch("r", ia, "int32")) if low else ia
        lo, hi = _host(*_min_max(_bits(nonzero, 2), scratch))
        if hi < lo:  # nothing but zeros
            return _empty(zeros=low)
        if not low or lo >= 2.0**-126:  # no subnormal (a NaN from quantize_v2 fails: the general path)
            counts = core.normal_counts(keys, spec)
            return LogHistogram.from_counts(counts, low, 0, amax=hi, amin_nonzero=lo)
    hi = ia.max() if not nonfinite else (ia * (ia < spec.inf)).max()
    hi, lo = _host(hi, ia.min() if not low else _min_nonzero(ia, spec))
    zeros = low if lo >= spec.normal else 0
    if low and not zeros:  # subnormals: float32's are normal in float64; float64's are below 2^B_MIN
        if spec is _F32:
            return _hist(a.astype("float64"), _F64, None)
        zeros = int(_host((ia == 0).sum())[0])
    counts = core.normal_counts(keys, spec)
    counts[0] += low - zeros
    return LogHistogram.from_counts(
        counts,
        zeros=zeros,
        nonfinite=nonfinite,
        amax=_float(hi, spec) if hi > 0 else 0.0,
        amin_nonzero=_float(lo, spec) if 0 < lo < spec.inf else None,
    )


def _min_nonzero(ia, spec: _Spec):
    """The smallest non-zero value of the non-negative ints ``ia`` (``spec.inf`` or more: none)."""
    if spec is _F32:  # zero wraps to the largest int; + 1 in int64, where that does not overflow
        wrapped = _npi.bitwise_and_scalar((ia - 1).as_np_ndarray(), scalar=0x7FFFFFFF).as_nd_ndarray()
        return wrapped.min().astype("int64") + 1
    return (ia + (ia == 0) * spec.inf).min()


def _update(weight, before, before_hist: LogHistogram, scratch: _Scratch) -> LogHistogram:
    """The ratio histogram of this step's update of ``weight`` (``before``: its value before the step,
    ``before_hist`` its histogram).

    float32 weights, finite and zero or not below 2^-102: a non-zero update is then at least
    2^(b(w) - 24) (exact subtraction when ``after`` is within a factor 2 of ``w``, else over half of
    ``w``), so each ratio of a non-zero ``w`` is normal unless it reaches 2^128 (bounded by max |u|
    and min |w|). The ratios' bits (module docstring) are binned as a histogram, those of a zero
    ``u`` or ``w`` set to NaN (their key is a non-finite one: the ``w == 0`` are ``apart``, the others
    ``zeros``). Otherwise (or a non-finite update) ``_ratio64``. Float32 arrays in host memory take
    ``_host_update`` first (``before`` an NDArray or a numpy copy, ``_save``); a numpy ``before`` it
    leaves goes on as an NDArray on the same memory."""
    if dtype_name(weight.dtype) == dtype_name(before.dtype) == "float32":
        found = _host_update(weight, before, before_hist, scratch)
        if found is not None:
            return found
    if isinstance(before, np.ndarray):
        before = mx.nd.from_numpy(before.reshape(weight.shape), zero_copy=True).as_in_context(weight.context)
    spec = _spec(before.dtype)
    w = _flat(before, spec)
    fast = spec is _F32 and not before_hist.nonfinite and (before_hist.amin_nonzero or 1.0) >= 2.0**-102
    if not fast or dtype_name(before.dtype) != "float32":
        u = _flat(weight - before, spec)
        return _ratio64(mx.nd.abs(u, out=u), w)
    au = scratch("a", w, "float32")
    mx.nd.elemwise_sub(weight.reshape((-1,)), w, out=au)
    mx.nd.abs(au, out=au)
    finite, lo_u, hi_u = _host(mx.nd.all_finite(au), *_min_max(au, scratch))
    amin_w = before_hist.amin_nonzero
    if not finite or math.isnan(hi_u) or (amin_w and _binade(hi_u) - _binade(amin_w) > 127):
        return _ratio64(au, w)
    iu = _bits(au)
    rb = scratch("r", w, "int32")
    _npi.bitwise_and_scalar(_bits(w).as_np_ndarray(), scalar=spec.inf, out=rb.as_np_ndarray())  # 2^b(w)
    mx.nd.elemwise_sub(iu, rb, out=rb)
    rb += spec.bias << spec.mant  # the bits of |u| / 2^b(w)
    if lo_u == 0:
        mx.nd.where(iu, rb, scratch.nans(rb), out=rb)
    if before_hist.zeros:
        mx.nd.where(w, rb, scratch.nans(rb), out=rb)
    lo, hi = _host(*_min_max(_bits(rb, 2), scratch))
    if math.isnan(lo) or math.isnan(hi):  # a quantize_v2 that does not skip NaN
        return _ratio64(au, w)
    keys = _keys(rb, spec)
    special = int(keys[spec.inf >> spec.shift :].sum())
    regular = rb.size - special
    return LogHistogram.from_counts(
        core.normal_counts(keys, spec),
        zeros=special - before_hist.zeros,
        nonfinite=0,
        amax=hi if regular else 0.0,
        amin_nonzero=lo if regular else None,
        apart=before_hist.zeros,
    )


def _binade(x: float) -> int:
    return math.frexp(x)[1] - 1


def _ratio64(au, w) -> LogHistogram:
    """The general ratio histogram, in float64 (float32 subnormals are normal there): each element's
    index from the int64 keys of ``|u|`` and ``|w|`` (float64 subnormals scaled by 2^128 first), then
    non-finite, apart (w == 0) and zeros (u == 0) in that order; ``r = |u| / 2^b(w)`` by one division."""
    au = au.astype("float64")
    aw = mx.nd.abs(w.astype("float64"))
    iu, iw = _bits(au), _bits(aw)
    ku, ew = _exponent_key(au, iu, _F64.shift), _exponent_key(aw, iw, _F64.mant)
    idx = mx.nd.clip(ku - ew * SUB + _RATIO_OFFSET, 0, N_BINS - 1)
    bad = mx.nd.maximum(iu, iw) >= _F64.inf
    apart = iw == 0
    idx = mx.nd.where(iu == 0, mx.nd.ones_like(idx) * N_BINS, idx)
    idx = mx.nd.where(apart, mx.nd.ones_like(idx) * (N_BINS + 2), idx)
    idx = mx.nd.where(bad, mx.nd.ones_like(idx) * (N_BINS + 1), idx)
    keys = _npi.bincount(idx.as_np_ndarray(), minlength=N_BINS + 3).asnumpy().astype(np.int64)
    regular = idx < N_BINS
    r = au / mx.nd.power(2.0, (ew - _F64.bias).astype("float64"))
    hi, lo = _host(mx.nd.where(regular, r, mx.nd.zeros_like(r)).max(),
                   mx.nd.where(regular, r, mx.nd.ones_like(r) * np.inf).min())  # fmt: skip
    top = float(np.finfo(np.float64).max)
    regulars = int(keys[:N_BINS].sum())
    return LogHistogram.from_counts(
        keys[:N_BINS],
        zeros=int(keys[N_BINS]),
        nonfinite=int(keys[N_BINS + 1]),
        amax=min(hi, top) if regulars else 0.0,
        amin_nonzero=min(lo, top) if regulars and lo > 0 else None,
        apart=int(keys[N_BINS + 2]),
    )


def _exponent_key(a, ia, shift: int):
    """``ia >> shift`` of float64 magnitudes ``a`` (bits ``ia``) as if they were normal: subnormals
    scaled by 2^128 (exactly), their key then lowered by 128 binades. ``shift`` 52: the biased
    exponent E; ``SUB`` fewer: ``SUB * E + k``."""
    tiny = ia < _F64.normal
    # an array, not a scalar operand: MXNet passes scalars as text and parses 2^128 a bit low
    scale = mx.nd.array([2.0**128], ctx=a.context, dtype="float64")
    scaled = _bits(mx.nd.where(tiny, mx.nd.broadcast_mul(a, scale), a))
    return scaled / (1 << shift) - tiny * (128 << (_F64.mant - shift))
