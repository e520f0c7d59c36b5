"""The doctor's MXNet taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (Gluon's idiom): ``model`` is a ``gluon.Block`` (a HybridBlock, hybridized or not) whose
parameters are initialised on one context; ``batch`` is an NDArray ``x`` (``model(x)``; the loss is
``loss_fn(outputs, x)``) or a pair ``(inputs, targets)`` (``model(inputs)``, or ``model(*inputs)`` for a
tuple / list of inputs; the loss is ``loss_fn(outputs, targets)``, so a ``gluon.loss.Loss`` fits as is).
With ``loss_fn=None`` the outputs are the loss. A loss of one value per sample (``gluon.loss`` returns
shape ``(batch,)``) is reduced with ``.mean()``: the step is that of the mean loss, and ``optimizer`` (a
``gluon.Trainer``) steps with ``trainer.step(1)`` (batch_size 1: the mean already divides by the batch).

Algorithm: snapshot the parameters' values (all with a trainer; without one, those with
``grad_req='null'``, which the forward may write: BatchNorm's running statistics), gradients and their
"fresh" flags, and each HybridBlock's hybridization; the trainer's optimizer states are swapped for
copies, so the originals are never written. Then ``steps`` ordinary float32 steps with taps, under
``autograd.record(train_mode=True)`` and MXNet's float32 operators (``keep.float32_operators``: those
contrib.amp replaced are put back, process-wide, for the call). Hybridized blocks run imperatively
(``_active`` off, their cached graphs kept), so that every layer block's forward is seen:
- every layer block (``keep.layers``): its ``forward`` is wrapped (an instance attribute) to keep each
  floating output ("output") and return ``output + z``, ``z`` a -0.0 NDArray with ``attach_grad()``
  (adding -0.0 changes no bit, not even a -0.0): ``z.grad`` is the gradient w.r.t. the output
  ("grad_output"), kept when backward reached it; both are binned after backward, so that MXNet
  queues the whole forward and backward without waiting on the taps;
- every parameter in its layer: its value before the step ("weight"), its gradient after backward
  ("grad_weight"; those backward wrote, ``grad_req='add'`` ones zeroed first);
- with a trainer: ``trainer.step(1, ignore_stale_grad=True)``, and the update ``after - before`` of
  each of its parameters binned relative to the weight ("update_ratio"). Without one, no updates.
Then (in a ``finally``, also when the loss or the model raises) everything is put back, bitwise: values
and gradients copied back into the same arrays, flags, forwards, hybridization, the trainer's and its
optimizer's attributes, update counts, scheduler and states. One ``Observation`` per (layer, kind):
layers in ``keep.layers`` order, kinds in ``KINDS`` order, steps and calls merged. Not restorable:
MXNet's random generator (MXNet 1.9 has no API to read its state, only ``mx.random.seed``), so a
model that draws random numbers in training mode (``Dropout``) advances it.

Binning (``histogram``) runs MXNet ops on the array's context, into work buffers kept for the call
(``_Scratch``); the counts and a few scalars reach the host. MXNet has no bitcast: the int view of a
float array is its DLPack capsule relabelled (``_bits``: same memory, no copy). For a float32 ``a = |x|``
(fp16 and bf16 widened exactly) with int bits ``ia``, ``ia >> 19`` is ``SUB * biased exponent + k`` of
a normal float, the spec's index less a constant: one ``mx.nd.histogram`` of ``ia`` (4096 bins over
[0, 2^31), exact) counts every key, the low ones zeros and subnormals, the top ones inf/NaN. One
``contrib.quantize_v2`` gives the extremes (it reports min and max, skipping NaN), zeros masked as NaN;
subnormals (rare) are re-binned as float64, where they are normal; arrays with inf/NaN take int
reductions, float64 ones int64 bits and ``bincount``. An update ratio ``|u| / 2^b(w)`` (``_update``) is
the float whose bits are ``ia(u) - (bits(w) & 0x7f800000) + 0x3f800000``, binned the same way with zero
``u`` or ``w`` masked as NaN; its conditions (weights finite and not tiny, a finite update) are read off
the weight's histogram and one pass over the update. Otherwise (and in ``ratio_histogram``) float64
with masks: the index ``SUB * b(u) + k(u) - SUB * b(w)`` from int64 bits (float64 subnormals scaled by
2^128 first) and ``r = |u| / 2^b(w)`` from one division. The results equal ``LogHistogram.of(x.asnumpy())``
(``update_ratio_histogram``) exactly; each tapped array costs a few host reads (synchronisations).
"""

from __future__ import annotations

import ctypes
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..doctor.histogram import B_MIN, N_BINS, SUB, LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..errors import PolyampError
from ..frameworks import detect
from .keep import blocks, dtype_name, float32_operators, layers
from .ops import autograd, gluon, mx

_npi = mx.nd.numpy._internal  # MXNet 1.9's numpy-interface ops: bincount, bitwise_and

_LOG_SUB = SUB.bit_length() - 1  # SUB is a power of two
_RATIO_OFFSET = 1 - SUB * B_MIN  # spec index of a ratio = K(u) - SUB * E(w) + this (E biased, K = SUB*E + k)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


@dataclass(frozen=True)
class _Spec:
    """A float width: its dtype, int view and the key arithmetic of the module docstring."""

    dtype: str
    mant: int
    bias: int

    @property
    def shift(self) -> int:  # bits >> shift = SUB * biased exponent + k
        return self.mant - _LOG_SUB

    @property
    def normal(self) -> int:  # bits of the smallest normal
        return 1 << self.mant

    @property
    def inf(self) -> int:  # bits of inf (and the lowest NaN's)
        return (2 * self.bias + 1) << self.mant

    @property
    def keys(self) -> int:
        return (2 * self.bias + 2) * SUB

    @property
    def offset(self) -> int:  # spec index - key, for a normal float
        return 1 - SUB * (self.bias + B_MIN)


_F32, _F64 = _Spec("float32", 23, 127), _Spec("float64", 52, 1023)


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its gradients and
    the trainer ``optimizer`` are left exactly as they were (module docstring)."""
    _check(model, batch, loss_fn, steps, optimizer)
    table = layers(model)
    params = _parameters(model, optimizer)
    trained = [p for p in params if p.grad_req != "null"]
    stepped = {id(p) for p in optimizer._params if p.grad_req != "null"} if optimizer is not None else set()
    # without a trainer only the forward writes parameters (running statistics): gradients are put back
    values = [(d, d.copy()) for p in params if optimizer is not None or p.grad_req == "null"
              for d in p.list_data()]  # fmt: skip
    grads = [(g, g.copy()) for p in trained for g in p.list_grad()]
    fresh = [(d, d._fresh_grad) for p in trained for d in p.list_data()]
    hybrid = [(b, b._active) for _, b in blocks(model) if isinstance(b, gluon.HybridBlock)]
    trainer = _TrainerState(optimizer) if optimizer is not None else None
    found: dict[tuple[str, str], list[LogHistogram]] = defaultdict(list)
    taps: list[tuple[str, mx.nd.NDArray, mx.nd.NDArray]] = []
    wrapped, scratch = [], _Scratch()
    try:
        with float32_operators():
            for block, _ in hybrid:
                block._active = False  # run imperatively: each leaf's forward is called, and seen
            for layer in table:
                if layer.leaf:
                    wrapped.append((layer.block, vars(layer.block).get("forward")))
                    vars(layer.block)["forward"] = _tapped(layer.name, layer.block.forward, taps)
            saved = {id(d): v for d, v in values}
            before = {id(p): saved[id(p.data())] for p in params if id(p.data()) in saved}
            for step in range(steps):
                weights = _step(model, batch, loss_fn, table, trained, found, taps, scratch)
                if optimizer is None:
                    continue
                optimizer.step(1, ignore_stale_grad=True)
                for layer in table:
                    ps = [p for p in layer.params if id(p) in stepped]
                    ratios = [_update(p.data(), before[id(p)], weights[id(p)], scratch) for p in ps]
                    found[layer.name, "update_ratio"] += ratios
                if step + 1 < steps:  # the snapshot stays as it is; later steps start from a copy
                    before = {i: _copy_into(p.data(), before[i] if step else None)
                              for p in params if (i := id(p)) in before}  # fmt: skip
    finally:
        for block, forward in wrapped:
            if forward is None:
                vars(block).pop("forward", None)
            else:
                vars(block)["forward"] = forward
        for block, active in hybrid:
            block._active = active
        for d, value in values:
            d[:] = value
        for g, value in grads:
            g[:] = value
        for d, flag in fresh:
            d._fresh_grad = flag
        if trainer is not None:
            trainer.restore()
    return [Observation(layer.name, kind, found[layer.name, kind][0].merge(*found[layer.name, kind][1:]))
            for layer in table for kind in KINDS if found.get((layer.name, kind))]  # fmt: skip


def _step(model, batch, loss_fn, table, trained, found, taps, scratch) -> dict[int, LogHistogram]:
    """Forward and backward with taps; returns each layer parameter's weight histogram by id."""
    for p in trained:
        for d in p.list_data():
            d._fresh_grad = False  # backward sets it on what it writes
        if p.grad_req == "add":
            for g in p.list_grad():
                g[:] = 0
    taps.clear()
    weights = {id(p): histogram(p.data(), scratch) for layer in table for p in layer.params}
    for layer in table:
        found[layer.name, "weight"] += [weights[id(p)] for p in layer.params]
    with autograd.record(train_mode=True):
        loss = _loss(model, batch, loss_fn)
    _backward(loss)
    for name, out, z in taps:  # binned now, not in the forward: MXNet queues the forward and backward
        found[name, "output"].append(histogram(out, scratch))
        if z._fresh_grad:
            found[name, "grad_output"].append(histogram(z.grad, scratch))
    for layer in table:
        grads = [p.grad() for p in layer.params if p.grad_req != "null" and p.data()._fresh_grad]
        found[layer.name, "grad_weight"] += [histogram(g, scratch) for g in grads]
    return weights


def _copy_into(value, target):
    if target is None:
        return value.copy()
    value.copyto(target)
    return target


def _tapped(name: str, forward, taps):
    """``forward`` that keeps each floating output (in ``taps``, binned after backward) and returns
    it plus a -0.0 gradient tap."""

    def tap(out):
        if isinstance(out, (list, tuple)):
            return type(out)(tap(o) for o in out)
        if not isinstance(out, mx.nd.NDArray) or dtype_name(out.dtype) not in _WIDTHS:
            return out
        with autograd.pause():
            z = -mx.nd.zeros(out.shape, ctx=out.context, dtype=out.dtype)
        z.attach_grad()
        taps.append((name, out, z))
        return out + z

    def tapped(*args):
        return tap(forward(*args))

    return tapped


def _backward(loss) -> None:
    try:
        loss.backward()
    except mx.base.MXNetError as err:
        if "not in a computational graph" not in str(err):
            raise
        raise PolyampError(
            "the loss does not depend on any parameter with a gradient (it was not computed from the "
            "model's outputs inside autograd.record, or every parameter has grad_req='null')"
        ) from None


class _TrainerState:
    """What ``trainer.step`` changes, and its restore: the trainer's and its optimizer's attributes
    (shallow), the optimizer's update counts and LR scheduler, and each updater's states, swapped for
    copies during the step (so the original state arrays are never written)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.attrs = dict(vars(trainer))
        opt = trainer._optimizer
        self.opt_attrs = dict(vars(opt))
        self.counts = {k: dict(v) for k, v in opt._all_index_update_counts.items()}
        sched = opt.lr_scheduler
        self.sched = (sched, dict(vars(sched))) if sched is not None else None
        self.updaters = [(u, dict(vars(u))) for u in trainer._updaters]
        for u, _ in self.updaters:
            u.states = {k: _copy_state(v) for k, v in u.states.items()}
            u.states_synced = dict(u.states_synced)

    def restore(self) -> None:
        opt = self.trainer._optimizer
        for u, attrs in self.updaters:
            vars(u).clear()
            vars(u).update(attrs)
        counts = opt._all_index_update_counts
        for k in list(counts):
            if k not in self.counts:
                del counts[k]
        for k, v in self.counts.items():
            counts.setdefault(k, {}).clear()
            counts[k].update(v)
        if self.sched is not None:
            vars(self.sched[0]).clear()
            vars(self.sched[0]).update(self.sched[1])
        vars(opt).clear()
        vars(opt).update(self.opt_attrs)
        vars(self.trainer).clear()
        vars(self.trainer).update(self.attrs)


def _copy_state(state):
    if isinstance(state, mx.nd.NDArray):
        return state.copy()
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s) for s in state)
    return state


# -- checks ---------------------------------------------------------------------------------------
def _check(model, batch, loss_fn, steps, optimizer) -> None:
    if not isinstance(model, gluon.Block):
        raise PolyampError(f"model: expected a mxnet.gluon.Block, got {_type(model)}")
    params = list(model.collect_params().values())
    if not any(p.grad_req != "null" for p in params):
        which = "no parameters" if not params else "no parameter with a gradient (all grad_req='null')"
        raise PolyampError(f"model {_type(model)} has {which}; the doctor observes the weights it trains")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolyampError(f"steps must be a whole number >= 1, got {steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise PolyampError(f"loss_fn must be callable(outputs, targets) or None, got {_type(loss_fn)}")
    if optimizer is not None:
        _check_trainer(optimizer)
    for leaf in _leaves(batch):
        if not isinstance(leaf, mx.nd.NDArray) and (isinstance(leaf, np.ndarray) or detect(leaf) is not None):
            raise PolyampError(
                f"batch: expected mxnet NDArrays, got {_type(leaf)}; convert it with mx.nd.array(...) "
                "(on the model's context) or pass a batch of the model's framework"
            )
    if isinstance(batch, (tuple, list)) and len(batch) != 2:
        raise PolyampError(f"batch: expected an NDArray or an (inputs, targets) pair, got a "
                           f"{type(batch).__name__} of {len(batch)} items")  # fmt: skip
    if not isinstance(batch, (tuple, list, mx.nd.NDArray)):
        raise PolyampError(f"batch: expected an NDArray or an (inputs, targets) pair, got {_type(batch)}")
    contexts = set()
    for p in params:
        try:
            contexts.update(p.list_ctx())
            p.list_data()
        except (RuntimeError, mx.gluon.parameter.DeferredInitializationError):
            raise PolyampError(
                f"parameter {p.name} of the model is not initialised (or waits for deferred "
                "initialisation at the first forward); call model.initialize() and run the model "
                "once, or give its layers their input sizes (in_units=...), before collect"
            ) from None
    if len(contexts) > 1:
        raise PolyampError(
            f"the model's parameters live on {len(contexts)} contexts ({', '.join(map(str, contexts))}); "
            "collect observes one device's step: pass a model initialised on one context"
        )


def _check_trainer(trainer) -> None:
    if not isinstance(trainer, gluon.Trainer):
        raise PolyampError(f"optimizer: expected a mxnet.gluon.Trainer or None, got {_type(trainer)}")
    if getattr(trainer, "_amp_loss_scaler", None) is not None:
        raise PolyampError(
            "optimizer: this trainer went through contrib.amp.init_trainer, whose loss scaler scales "
            "and skips its steps; collect runs a plain float32 step: pass a trainer amp has not seen"
        )
    kvstore = trainer._kvstore if trainer._kv_initialized else trainer._kvstore_params["kvstore"]
    if isinstance(kvstore, mx.kvstore.KVStore) or "dist" in str(kvstore):
        raise PolyampError(
            f"optimizer: the trainer uses a kvstore ({getattr(kvstore, 'type', kvstore)}), which keeps "
            "optimizer state collect cannot put back; pass a trainer on one device (kvstore='device' "
            "or None)"
        )


def _parameters(model, trainer) -> list:
    own = list(model.collect_params().values())
    extra = list(trainer._params) if trainer is not None else []
    return list({id(p): p for p in own + extra}.values())


def _type(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _leaves(x):
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    return [x]


def _loss(model, batch, loss_fn):
    inputs, targets = batch if isinstance(batch, (tuple, list)) else (batch, batch)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    try:
        outputs = model(*args)
    except (mx.base.MXNetError, ValueError, TypeError, AssertionError) as err:
        shapes = [tuple(a.shape) for a in args if isinstance(a, mx.nd.NDArray)]
        raise PolyampError(f"the model's forward failed on the batch (input shapes {shapes}): {err}") from err
    loss = loss_fn(outputs, targets) if loss_fn is not None else outputs
    source = "loss_fn(outputs, targets)" if loss_fn is not None else "the model (loss_fn=None)"
    rows = args[0].shape[0] if args and isinstance(args[0], mx.nd.NDArray) and args[0].ndim else None
    if not isinstance(loss, mx.nd.NDArray) or dtype_name(loss.dtype) not in _WIDTHS:
        what = f"{dtype_name(loss.dtype)} NDArray" if isinstance(loss, mx.nd.NDArray) else _type(loss)
        raise PolyampError(f"{source} must return a floating-point loss NDArray, got {what}")
    if loss.size != 1:
        if loss.ndim != 1 or loss.shape[0] != rows:
            raise PolyampError(f"{source} must return a scalar loss or one per sample (shape ({rows},)), "
                               f"got shape {tuple(loss.shape)}")  # fmt: skip
        loss = loss.mean()  # gluon.loss: one value per sample
    return loss


# -- binning in MXNet -----------------------------------------------------------------------------
_WIDTHS = {"float16": _F32, "bfloat16": _F32, "float32": _F32, "float64": _F64}
_NAN_BITS = 0x7FC00000  # a float32 NaN: quantize_v2's min and max skip it, its key is a non-finite one


class _Scratch:
    """Flat work buffers kept for one ``collect`` (by slot, dtype and context): MXNet writes into an
    existing NDArray several times faster than into a fresh one, whose pages fault in on CPU."""

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


def _spec(dtype) -> _Spec:
    name = dtype_name(dtype)
    if name not in _WIDTHS:
        raise PolyampError(f"cannot bin a {name} NDArray; accepted: {', '.join(_WIDTHS)}")
    return _WIDTHS[name]


def _flat(x, spec: _Spec):
    x = x.reshape((-1,))
    return x if dtype_name(x.dtype) == spec.dtype else x.astype(spec.dtype)


def histogram(x, scratch: _Scratch | None = None) -> LogHistogram:
    """The ``LogHistogram`` of a floating NDArray, binned by MXNet on its context (module docstring)."""
    spec = _spec(x.dtype)
    if not x.size:
        return _empty()
    with autograd.pause():
        x = _flat(x, spec)
        if spec is not _F32:
            return _hist(mx.nd.abs(x), spec, None)
        scratch = scratch or _Scratch()
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
    managed = ctypes.POINTER(mx.nd.ndarray.DLManagedTensor)
    tensor = ctypes.cast(_capsule_pointer(capsule, b"dltensor"), managed).contents
    tensor.dl_tensor.dtype.type_code = code
    return mx.nd.from_dlpack(capsule)


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


def _float(bits: int, spec: _Spec) -> float:
    return float(np.array(bits, "int" + spec.dtype[5:]).view(spec.dtype))


def _empty(zeros: int = 0) -> LogHistogram:
    return LogHistogram.from_counts(np.zeros(N_BINS, np.int64), zeros, 0, 0.0)


def _spec_counts(keys: np.ndarray, spec: _Spec) -> np.ndarray:
    """The spec's counts of the normal floats among the key counts ``keys``."""
    top = spec.inf >> spec.shift
    counts = np.zeros(N_BINS, np.int64)
    np.add.at(counts, np.clip(np.arange(SUB, top) + spec.offset, 0, N_BINS - 1), keys[SUB:top])
    return counts


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
            counts = _spec_counts(keys, spec)
            return LogHistogram.from_counts(counts, low, 0, amax=hi, amin_nonzero=lo)
    hi = ia.max() if not nonfinite else (ia * (ia < spec.inf)).max()
    hi, lo = _host(hi, ia.min() if not low else _min_nonzero(ia, spec))
    zeros = low if lo >= spec.normal else 0
    if low and not zeros:  # subnormals: float32's are normal in float64; float64's are below 2^B_MIN
        if spec is _F32:
            return _hist(a.astype("float64"), _F64, None)
        zeros = int(_host((ia == 0).sum())[0])
    counts = _spec_counts(keys, spec)
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
    ``zeros``). Otherwise (or a non-finite update) ``_ratio64``."""
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
        _spec_counts(keys, spec),
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
