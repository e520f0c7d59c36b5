"""The doctor's MXNet taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (Gluon's idiom): ``model`` is a ``gluon.Block`` (a HybridBlock, hybridized or not) whose
parameters are initialised on one context; ``batch`` is an NDArray ``x`` (``model(x)``; the loss is
``loss_fn(outputs, x)``) or a pair ``(inputs, targets)`` (``model(inputs)``, or ``model(*inputs)`` for a
tuple / list of inputs; the loss is ``loss_fn(outputs, targets)``, so a ``gluon.loss.Loss`` fits as is).
With ``loss_fn=None`` the outputs are the loss. A loss of one value per sample (``gluon.loss`` returns
shape ``(batch,)``) is reduced with ``.mean()``: the step is that of the mean loss, and ``optimizer`` (a
``gluon.Trainer``) steps with ``trainer.step(1)`` (batch_size 1: the mean already divides by the batch).

Algorithm: the steps run on copies (``_Sandbox``), so that the user's arrays are never written: the
parameters the steps write compute on working copies swapped in for their own arrays (with a trainer
all of them; without one, those with ``grad_req='null'``, which the forward may write: BatchNorm's
running statistics), every parameter with a gradient gets fresh gradient buffers, and the trainer's
optimizer states are swapped for copies. Then ``steps`` ordinary float32 steps with taps, under
``autograd.record(train_mode=True)`` and MXNet's float32 operators (``keep.float32_operators``: those
contrib.amp replaced are put back, process-wide, for the call). Hybridized blocks run imperatively
(``_active`` off, their cached graphs kept), so that every layer block's forward is seen:
- every layer block (``keep.layers``): its ``forward`` is wrapped (an instance attribute) to keep each
  floating output ("output") and return ``output + z``, ``z`` a -0.0 NDArray with a gradient buffer
  (adding -0.0 changes no bit, not even a -0.0): ``z``'s gradient is the gradient w.r.t. the output
  ("grad_output"), kept when backward reached it;
- every parameter in its layer: its value before the step ("weight"), its gradient after backward
  ("grad_weight"; those backward wrote, ``grad_req='add'`` ones zeroed first);
- with a trainer: ``trainer.step(1, ignore_stale_grad=True)``, and the update ``after - before`` of
  each of its parameters binned relative to the weight ("update_ratio"). Without one, no updates.
MXNet computes each forward and backward, and each trainer step, alone: the binning waits for it
(``mx.nd.waitall``); run at once, the two slowed each other down by more than they overlapped. Then (in
a ``finally``, also when the loss or the model raises) the original arrays are put back, which
restores them bitwise with no copy back, and so are the gradients' "fresh" flags, forwards,
hybridization, the trainer's and its optimizer's attributes, update counts and scheduler. One
``Observation`` per (layer, kind): layers in ``keep.layers`` order, kinds in ``KINDS`` order, steps
and calls merged. Not restorable: MXNet's random generator (MXNet 1.9 has no API to read its state,
only ``mx.random.seed``), so a model that draws random numbers in training mode (``Dropout``)
advances it.

Binning (``histogram``): which path runs where.
- Host memory (contexts cpu, cpu_pinned, cpu_shared), default storage and layout, float32 (fp16 and
  bf16 widened exactly): numpy, on a view of the NDArray's memory (``_host_view``: its DLPack
  capsule, taken after MXNet's pending writes and held while the view is read; no copy, and no view
  outlives the call that made it). A float32 array on ``mx.cpu()`` in MKL-DNN's blocked layout, which
  has no such view, is first written by MXNet's ``abs`` into numpy memory.
- Everything else (GPU contexts, float64): MXNet ops on the array's context, into work buffers kept for
  the call (``_Scratch``); only the counts and a few scalars reach the host.
Both read the float32 bits ``a`` of ``|x|``: for a normal float ``a >> 19`` is ``SUB * biased exponent +
k``, the spec's index less a constant; the low keys are zeros and subnormals, the top ones inf/NaN.
numpy (``doctor/binning_host.py``) takes chunks of ``CHUNK`` elements, whose work buffers stay in cache:
``bincount(a >> 19)``, ``a.min()`` and ``a.max()``; in a chunk with zeros or inf/NaN the extremes
come from ``(a - 1) & 0x7fffffff`` and ``(a - 0x7f800000) & 0x7fffffff``, its subnormals (rare) from
the core's ``bin_index``. MXNet has no bitcast: its int view of a float array is the DLPack capsule
relabelled (``_bits``); one ``mx.nd.histogram`` of ``a`` (4096 bins over [0, 2^31), exact) counts the
keys, one ``contrib.quantize_v2`` gives the extremes (min and max, skipping NaN; zeros masked as NaN),
subnormals are re-binned as float64, arrays with inf/NaN take int reductions, float64 ones int64 bits
and ``bincount``. An update ratio ``|u| / 2^b(w)`` (``_update``) of float32 weights, finite and not
below 2^-102, is the float whose bits are ``a(u) - (bits(w) & 0x7f800000) + 0x3f800000``, binned the
same way (numpy: ``u = after - before`` per chunk; zero ``u`` or ``w`` set to 0, MXNet: to NaN);
otherwise (and in ``ratio_histogram``) MXNet in float64 with masks: the index ``SUB * b(u) + k(u) -
SUB * b(w)`` from int64 bits (float64 subnormals scaled by 2^128 first) and ``r = |u| / 2^b(w)`` from
one division. The results equal ``LogHistogram.of(x.asnumpy())`` (``update_ratio_histogram``) exactly.

Memory, on ``mx.cpu()`` (``_in_numpy``): the working copies, gradient buffers, optimizer state copies
and the taps' sums and ``z`` lie in numpy memory (``from_numpy``), whose large allocations fault in as
huge pages, several times faster than MXNet's fresh arrays, 4 KiB page by page; ``_host_array``
places the arrays one kernel streams together in different lanes (4K aliasing).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..doctor import binning_host as host
from ..doctor import blocks as _blocks
from ..doctor.histogram import LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..doctor.taps import leaves as _leaves
from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..frameworks import detect
from .binning import (
    _WIDTHS,
    _host_array,
    _host_view,
    _in_numpy,
    _Scratch,
    _update,
    histogram,
    ratio_histogram,
)
from .doctor_recipe import RecipeTensors
from .keep import blocks, dtype_name, float32_operators, layers
from .ops import autograd, gluon, mx


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None, measure=()) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its gradients and
    the trainer ``optimizer`` are left exactly as they were (module docstring). ``measure``:
    ``blocks.Target``s, measured on a numpy copy (``.asnumpy()``) by ``blocks.measure``; a recipe only
    on what it quantizes (``doctor_recipe.py``)."""
    _check(model, batch, loss_fn, steps, optimizer)
    table = layers(model)
    params = _parameters(model, optimizer)
    stepped = {id(p) for p in optimizer._params if p.grad_req != "null"} if optimizer is not None else set()
    fresh = [(d, d._fresh_grad) for p in params if p.grad_req != "null" for d in p.list_data()]
    hybrid = [(b, b._active) for _, b in blocks(model) if isinstance(b, gluon.HybridBlock)]
    sandbox = _Sandbox(params, optimizer)
    found: dict[tuple[str, str], list[LogHistogram]] = defaultdict(list)
    taps: list[tuple[str, mx.nd.NDArray, mx.nd.NDArray, mx.nd.NDArray]] = []
    wrapped, scratch, addends = [], _Scratch(), _Addends()
    recipes = tuple(t for t in measure if t.label.startswith(_blocks.PREFIX))
    meter = _blocks.Meter(tuple(t for t in measure if t not in recipes), mx.nd.NDArray.asnumpy)
    recipe = RecipeTensors(model, recipes, mx.nd.NDArray.asnumpy)
    try:
        with float32_operators():
            for block, _ in hybrid:
                block._active = False  # run imperatively: each leaf's forward is called, and seen
            for layer in table:
                if layer.leaf:
                    wrapped.append((layer.block, vars(layer.block).get("forward")))
                    fed = recipe.fed if recipes and recipe.gemm(layer.name) else None
                    forward = _tapped(layer.name, layer.block.forward, taps, addends, fed)
                    vars(layer.block)["forward"] = forward
            sandbox.enter(scratch)
            for step in range(steps):
                weights = _step(model, batch, loss_fn, table, sandbox, found, taps, scratch, (meter, recipe))
                if optimizer is None:
                    continue
                optimizer.step(1, ignore_stale_grad=True)
                mx.nd.waitall()
                for layer in table:
                    ps = [p for p in layer.params if id(p) in stepped]
                    ratios = [_update(p.data(), sandbox.before[id(p)], weights[id(p)], scratch) for p in ps]
                    found[layer.name, "update_ratio"] += ratios
                if step + 1 < steps:
                    sandbox.next_before(scratch)
    finally:
        for block, forward in wrapped:
            if forward is None:
                vars(block).pop("forward", None)
            else:
                vars(block)["forward"] = forward
        for block, active in hybrid:
            block._active = active
        sandbox.restore()
        for d, flag in fresh:
            d._fresh_grad = flag
    return [Observation(layer.name, kind, found[layer.name, kind][0].merge(*found[layer.name, kind][1:]),
                        {**_blocks.merged(meter.parts, (layer.name, kind)),
                         **_blocks.merged(recipe.meter.parts, (layer.name, kind))})
            for layer in table for kind in KINDS if found.get((layer.name, kind))]  # fmt: skip


class _Sandbox:
    """The steps write copies, never the user's arrays. For the call, the parameters the steps write
    compute on working copies of their values, swapped in for their own (with a trainer all of them,
    as its step writes them; without, those without gradient, as the forward writes them: running
    statistics), each parameter with a gradient has fresh gradient buffers (marked for autograd on
    the data it computes on), and the trainer's optimizer states are copies (``_TrainerState``).
    Putting the original arrays back restores everything, bitwise, with no copy back (a parameter
    that computed on its own data is marked back onto its own gradient buffers). The copies lie in
    numpy memory where ``_in_numpy``; float32 ones are binned as they are made (the first weights)."""

    def __init__(self, params, trainer) -> None:
        self.params, self.trainer = params, trainer
        self.swapped: list[tuple] = []  # (parameter, its data list, its gradient list, data swapped)
        self.binned: dict[int, LogHistogram] = {}  # parameter id -> its weights' histogram, if binned
        self.before: dict[int, object] = {}  # parameter id -> its values before this step's update
        self.trainer_state: _TrainerState | None = None

    def enter(self, scratch: _Scratch) -> None:
        for p in self.params:
            data, grad = p._data, p._grad
            swap = self.trainer is not None or p.grad_req == "null"
            self.swapped.append((p, data, grad, swap))
            if swap:
                copies = [_copy_binned(x, scratch) for x in data]
                p._data = [copy for copy, _ in copies]
                self.binned[id(p)] = copies[0][1]
                self.before[id(p)] = data[0]
            if p.grad_req != "null" and grad is not None:
                p._grad = [_gradient_buffer(g, p.grad_req) for g in grad]
                autograd.mark_variables(p._data, p._grad, p.grad_req)
        if self.trainer is not None:
            self.trainer_state = _TrainerState(self.trainer)
            self.trainer_state.swap()

    def next_before(self, scratch: _Scratch) -> None:
        """After a step's update: the values the next step starts from, its "before" and weights
        (the originals stay as they are; a copy of the working values, reused from step to step)."""
        for p in self.params:
            if id(p) in self.before:
                into = self.before[id(p)] if isinstance(self.before[id(p)], np.ndarray) else None
                self.before[id(p)], self.binned[id(p)] = _save_binned(p.data(), scratch, into)

    def restore(self) -> None:
        for p, data, grad, swap in reversed(self.swapped):
            p._data, p._grad = data, grad
            if not swap and p.grad_req != "null" and grad is not None:
                autograd.mark_variables(data, grad, p.grad_req)
        if self.trainer_state is not None:
            self.trainer_state.restore()


def _step(model, batch, loss_fn, table, sandbox, found, taps, scratch, meters) -> dict[int, LogHistogram]:
    """Forward and backward with taps, then the histograms and (``meters``: the block formats' and the
    recipes') measurements; returns each layer parameter's weight histogram by id. The binning waits
    for MXNet's queued work (``mx.nd.waitall``): run at once, MXNet's kernels and numpy's binning (and
    its Python, holding the GIL) slow each other down by more than they overlap."""
    layer_params = list({id(p): p for layer in table for p in layer.params}.values())
    weights = {i: sandbox.binned.pop(i) for p in layer_params if (i := id(p)) in sandbox.binned}
    weights.update((id(p), histogram(p.data(), scratch)) for p in layer_params if id(p) not in weights)
    sandbox.binned.clear()
    for layer in table:
        found[layer.name, "weight"] += [weights[id(p)] for p in layer.params]
        for p in layer.params:
            for meter in meters:
                meter.add(layer.name, "weight", p.data())
    taps.clear()
    meters[1].fed.clear()
    with autograd.record(train_mode=True):
        loss = _loss(model, batch, loss_fn)
    for p in sandbox.params:
        if p.grad_req != "null":
            for d in p.list_data():
                d._fresh_grad = False  # backward sets it on what it writes
        if p.grad_req == "add":
            for g in p.list_grad():
                g[:] = 0
    _backward(loss)
    mx.nd.waitall()
    for name, out, z, tapped in taps:
        found[name, "output"].append(histogram(out, scratch))
        meters[0].add(name, "output", out)
        meters[1].add(name, "output", out, fed_as=tapped)
        if z._fresh_grad:
            found[name, "grad_output"].append(histogram(z.grad, scratch))
            for meter in meters:
                meter.add(name, "grad_output", z.grad)
    for layer in table:
        grads = [p.grad() for p in layer.params if p.grad_req != "null" and p.data()._fresh_grad]
        found[layer.name, "grad_weight"] += [histogram(g, scratch) for g in grads]
        for g in grads:
            meters[0].add(layer.name, "grad_weight", g)
    return weights


def _save(x, into=None, lane: int = 0):
    """A copy of ``x``'s values (into ``into``, an earlier copy of ``x``, if given): of host memory a
    flat numpy array (``_host_array``), else an NDArray."""
    if np.dtype(x.dtype).names is None:  # not bfloat16, which numpy and from_numpy do not know
        with _host_view(x, x.dtype) as view:
            if view is not None:
                out = _host_array(view.size, view.dtype, lane) if into is None else into
                np.copyto(out, view)
                return out
    if into is None:
        return x.copy()
    x.copyto(into)
    return into


def _save_binned(x, scratch: _Scratch, into=None, lane: int = 0) -> tuple:
    """``(_save(x, into), histogram(x))``, in one pass over a float32 array in host memory."""
    if dtype_name(x.dtype) == "float32":
        with _host_view(x, np.int32) as view:
            if view is not None:
                out = _host_array(x.size, np.float32, lane) if into is None else into  # flat, as _save's
                return out, host.histogram(view, "float32", scratch.host, copy=out.view(np.int32))
    return _save(x, into, lane), histogram(x, scratch)


def _copy_binned(x, scratch: _Scratch) -> tuple:
    """A working copy of ``x`` (an array of its type; in numpy memory where ``_in_numpy``) and the
    histogram of its values."""
    values, hist = _save_binned(x, scratch)
    if isinstance(values, mx.nd.NDArray):
        return values, hist
    if _in_numpy(x):
        return mx.nd.from_numpy(values.reshape(x.shape), zero_copy=True, array_cls=type(x)), hist
    return x.copy(), hist


def _gradient_buffer(x, grad_req: str):
    """A fresh gradient buffer like ``x``: where ``_in_numpy``, in numpy memory (lane 1), zeros for
    ``grad_req='add'`` and left as it is for 'write' (backward writes it whole, and one it did not
    write is not read); else MXNet's zeros."""
    if _in_numpy(x):
        buffer = _host_array(x.size, x.dtype, lane=1, zeros=grad_req == "add").reshape(x.shape)
        return mx.nd.from_numpy(buffer, zero_copy=True, array_cls=type(x))
    return mx.nd.zeros(x.shape, ctx=x.context, dtype=x.dtype, stype=x.stype)


def _tapped(name: str, forward, taps, addends: _Addends, fed: list | None = None):
    """``forward`` that keeps each floating output (in ``taps``, binned after backward) and returns
    it plus a -0.0 gradient tap (``addends``); ``fed``: a list its first argument is appended to."""

    def tap(out):
        if isinstance(out, (list, tuple)):
            return type(out)(tap(o) for o in out)
        if not isinstance(out, mx.nd.NDArray) or dtype_name(out.dtype) not in _WIDTHS:
            return out
        tapped, z = addends(out)
        taps.append((name, out, z, tapped))
        return tapped

    def tapped(*args):
        if fed is not None and args:
            fed.append(args[0])
        return tap(forward(*args))

    return tapped


class _Addends:
    """``out + z`` and ``z``, a -0.0 array with a gradient buffer. Where ``_in_numpy(out)`` all three
    lie in numpy memory: the ``z`` are views of one shared buffer of -0.0 (only read), the sums and
    gradients buffers of their own (written once, by the forward and the backward)."""

    def __init__(self) -> None:
        self._zeros: dict[np.dtype, np.ndarray] = {}

    def __call__(self, out) -> tuple:
        dtype = np.dtype(out.dtype)
        if not _in_numpy(out):
            with autograd.pause():
                z = -mx.nd.zeros(out.shape, ctx=out.context, dtype=out.dtype)
            z.attach_grad()
            return out + z, z
        zeros = self._zeros.get(dtype)
        if zeros is None or zeros.size < out.size:
            zeros = self._zeros[dtype] = _host_array(out.size, dtype, lane=1)
            zeros[:] = -0.0
        z = mx.nd.from_numpy(zeros[: out.size].reshape(out.shape), zero_copy=True)
        autograd.mark_variables(z, self._buffer(out, lane=2))
        return mx.nd.elemwise_add(out, z, out=self._buffer(out, lane=3)), z

    @staticmethod
    def _buffer(like, lane: int):
        return mx.nd.from_numpy(_host_array(like.size, like.dtype, lane).reshape(like.shape), zero_copy=True)


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
    copies (``swap``) during the step (so the original state arrays are never written)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.attrs = dict(vars(trainer))
        opt = trainer._optimizer
        self.opt_attrs = dict(vars(opt))
        self.counts = {k: dict(v) for k, v in opt._all_index_update_counts.items()}
        sched = opt.lr_scheduler
        self.sched = (sched, dict(vars(sched))) if sched is not None else None
        self.updaters = [(u, dict(vars(u))) for u in trainer._updaters]

    def swap(self) -> None:
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


def _copy_state(state, lane: int = 2):
    """A copy of an optimizer state (an NDArray, or a tuple of them and others): in numpy memory where
    ``_in_numpy`` (the states of a tuple in lanes 2, 3, ...), else MXNet's."""
    if isinstance(state, mx.nd.NDArray):
        saved = _save(state, lane=lane) if _in_numpy(state) else None
        if isinstance(saved, np.ndarray):
            return mx.nd.from_numpy(saved.reshape(state.shape), zero_copy=True, array_cls=type(state))
        return state.copy()
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s, lane + i) for i, s in enumerate(state))
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


__all__ = ["collect", "histogram", "ratio_histogram"]
