"""The doctor's TensorFlow / Keras 3 taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the Keras idiom): ``model`` is a Keras model or layer, called as ``model(x, training=True)``;
``batch`` is what ``fit`` takes: ``(x, y)`` or ``(x, y, sample_weight)`` (a tuple or list; x a tensor, or a
tuple / list / dict of tensors), or ``x`` alone (a tensor or a dict); TensorFlow tensors or numpy arrays
(``as_tensors``: converted, floating ones not in floatx cast to it, as ``fit`` does).
``loss_fn(y_true, y_pred)`` in Keras's order (a ``keras.losses.Loss`` or any callable; given
``sample_weight=`` when the batch has one); with ``x`` alone, ``y_true`` is ``x``. With ``loss_fn=None`` the
model's compiled loss (``model.compute_loss``: the compiled loss, ``add_loss`` and regularisation losses)
when it was compiled with one (or overrides ``compute_loss``, or adds losses), else the outputs must be the
scalar loss. ``optimizer``: a Keras optimizer (not a ``LossScaleOptimizer``: pass its inner optimizer).

Algorithm: ``steps`` ordinary float32 steps, in float32: every layer whose dtype policy computes in
another dtype than its variables' ("mixed_float16", "mixed_bfloat16") is set to its variable dtype
meanwhile, as torch's doctor turns autocast off. Snapshot (reads: TensorFlow copies a variable's buffer
only when it is written while a read of it is alive) the model's variables (with its seed generators), its
metrics' variables, the optimizer's variables (an optimizer not yet built is first built for the model's
trainable variables, as its first ``apply`` would, so what is put back is its initial state), Keras's
global seed generator (forgotten again if the step makes it) and Python's random state (Keras seeds a
SeedGenerator made without a seed from it). Then each step, with taps:
- every leaf layer (``keep.named_layers``: layers without sub-layers) gets an instance ``call`` that
  records its floating outputs ("output"); one ``tape.gradient(loss, outputs + trainable variables)``
  gives the gradients w.r.t. them ("grad_output"; outputs the loss does not depend on have none);
- every trainable variable, grouped to the leaf layer that owns it (a variable owned directly by a layer
  with sub-layers is a layer of its own, "<layer>/<variable name>"): its value before the step ("weight")
  and its gradient ("grad_weight"; ``IndexedSlices`` made dense);
- with an ``optimizer``: ``optimizer.apply`` of the gradients that exist, and the update ``after -
  before`` of those variables binned relative to the weight ("update_ratio"). Without one, no updates.
Then (in a ``finally``, also when the loss or the model raises) everything is put back, bitwise: the
``call``s and dtype policies, the variables (the trainable ones only with an optimizer: nothing else
writes them), the optimizer's and the metrics' variables (a metric the compiled loss created during the
step is reset) and the random states. Not restorable: TensorFlow's legacy op-seeded random ops
(``tf.random.normal`` without a seed generator) and ``tf.random.Generator`` states.

The step runs as a graph, as ``fit`` runs it (``tf.function`` without autograph, inner ``tf.function``s
inlined; a model's ``jit_compile`` is not used): the taps record the outputs of the graph being traced, and
the one traced function does the forward, the loss, the gradients, the optimizer's ``apply`` and the
binning of every tapped tensor (``binning.records``: XLA kernels, exact), returning one int64 vector of
counts and extremes per step; the host sums them into the histograms. Its float ops are the graph's, which
grappler may fuse or reorder as in any ``tf.function`` step (a last-bit difference from an eager step).
Traced steps are kept, by model (held weakly; at most 4 a model), and reused while the model, ``loss_fn``
and ``optimizer`` are the same objects, the batch's structure, shapes and dtypes the same, and so are the
layers, their dtype policies and trainable flags, the variables (of the model, of its metrics, of the
optimizer) and Keras's global seed generator; a step that made the global seed generator is traced again
next time (it is forgotten after each call). As with ``fit``'s cached step, Python state the model's
``call`` or ``loss_fn`` read while tracing (an attribute changed later) is not seen again. The first call
for a model pays the tracing and XLA's compilation (seconds).

Eagerly instead (``tf.config.run_functions_eagerly``, for the forward pass and the gradient, also for a
model compiled with ``jit_compile``; each tensor binned as it comes by ``histogram`` and
``ratio_histogram``) when ``tf.config.functions_run_eagerly()`` is on, when the step cannot be traced (the
model or the loss fails in a graph: the eager run raises the error as a model's own step would, the
forward's wrapped with the input shapes) or a tapped layer runs inside a graph of its own (a
``tf.while_loop``, ``tf.cond``, an RNN's step: its outputs could not be recorded), or when the traced step
fails when run (an assertion in the loss: then after a restore, eagerly, for the error an eager step
raises). The checks' ``PolyampError``\\ s are the same either way.

Measured formats (``measure``: block formats and recipes, ``doctor/blocks.py``): the step runs eagerly,
and each output, output gradient, weight and weight gradient is copied to numpy (``.numpy()``) and
measured by the numpy reference ``blocks.measure``. A recipe measures only what it would quantize
(``_RecipeTensors``: the matmul layers ``mp.watch`` would quantize, the keep list aside): their kernels,
their output gradients and the outputs of the leaf layers that feed them.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections import defaultdict
from typing import NamedTuple

import keras
import tensorflow as tf

from ..doctor import blocks as _blocks
from ..doctor.histogram import LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..keras.keep import named_layers, sublayers
from .binning import Tally, histogram, ratio_histogram, records
from .doctor_input import as_tensors, check_input
from .snapshot import Snapshot, global_seed_generator


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None, measure=()) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its variables and
    ``optimizer`` are left exactly as they were (module docstring). ``measure``: ``blocks.Target``s."""
    batch = as_tensors(batch)
    check_input(model, batch, loss_fn, steps, optimizer)
    job = _Job(model, batch, loss_fn, optimizer)
    recipes = tuple(t for t in measure if t.label.startswith(_blocks.PREFIX))
    job.meter = _blocks.Meter(tuple(t for t in measure if t not in recipes), _numpy, kernels_in_out=True)
    if recipes:
        job.recipe = _RecipeTensors(model, _blocks.Meter(recipes, _numpy, kernels_in_out=True))
    try:
        eager = tf.config.functions_run_eagerly() or bool(measure)
        found = job.run(job.eager if eager else job.traced, steps)
    except _Untraceable:
        found = job.run(job.eager, steps)
    return [Observation(name, kind, _merged(found[name, kind]), job.measured(name, kind))
            for name, _, _ in job.layers for kind in KINDS if found.get((name, kind))]  # fmt: skip


def _numpy(t):
    return t.numpy()


class _RecipeTensors:
    """What a recipe would quantize, measured under the recipe targets: of each matmul layer a recipe can
    quantize (``recipe.matmul_layers``, the keep list aside), its kernel ("weight"), the gradient of its
    output ("grad_output") and its input, which is the "output" of the leaf layer that returned that
    tensor (an input computed by ops between layers, such as attention's context, has no row)."""

    def __init__(self, model, meter):
        from .recipe import matmul_layers

        self.meter = meter
        self.layers = {name: layer for name, layer, why in matmul_layers(model) if why is None}

    def add(self, name: str, kind: str, t, fed: list, before: dict) -> None:
        layer = self.layers.get(name)
        if kind == "grad_output" and layer is not None:
            self.meter.add(name, kind, t)
        elif kind == "weight" and layer is not None and t is before.get(id(layer.kernel)):
            self.meter.add(name, kind, t)
        elif kind == "output" and any(t is x for x in fed):
            self.meter.add(name, kind, t)


def _merged(hists: list[LogHistogram]) -> LogHistogram:
    return hists[0] if len(hists) == 1 else hists[0].merge(*hists[1:])


class _Untraceable(Exception):
    """The tapped step cannot run as a graph (or failed there): run it eagerly instead."""


class _Trace(NamedTuple):
    fn: object  # the concrete function: the batch's tensors -> one int64 vector; None: run eagerly
    spans: list  # ((layer, kind, layout), start, stop) of each histogram's record in it
    why: str = ""  # why it runs eagerly


class _Job:
    """One ``collect``: what it observes, and its steps, traced or eager, between a snapshot and its
    restore."""

    def __init__(self, model, batch, loss_fn, optimizer):
        self.model, self.loss_fn, self.opt = model, loss_fn, optimizer
        self.inputs = keras.utils.unpack_x_y_sample_weight(batch)  # x, y, sample_weight
        self.flat = [t for t in tf.nest.flatten(self.inputs) if t is not None]
        self.layers = _layers(model)
        self.trainable = list({id(v): v for v in model.trainable_variables}.values())
        self.sink = _Sink()
        self.meter = _blocks.Meter((), None)  # the measured formats' statistics
        self.recipe: _RecipeTensors | None = None  # and the recipes', on what they quantize

    def measured(self, name: str, kind: str) -> dict:
        out = _blocks.merged(self.meter.parts, (name, kind))
        if self.recipe is not None:
            out.update(_blocks.merged(self.recipe.meter.parts, (name, kind)))
        return out

    def run(self, steps_of, steps: int) -> dict[tuple[str, str], list[LogHistogram]]:
        """``steps_of(steps, snapshot)`` in float32, everything put back afterwards."""
        state = Snapshot(self.model, self.opt)
        try:
            state.float32_compute()
            if self.opt is not None:
                state.optimizer(self.trainable)
            return steps_of(steps, state)
        finally:
            state.restore()

    def traced(self, steps: int, state) -> dict[tuple[str, str], list[LogHistogram]]:
        """``steps`` calls of the traced step (kept: ``_Traces``); only its vectors reach the host."""
        trace = _TRACES.get(self) or _TRACES.put(self, self.trace())
        if trace.fn is None:
            raise _Untraceable(trace.why)
        tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)
        for _ in range(steps):
            try:
                record = trace.fn(*self.flat).numpy()
            except tf.errors.OpError as err:
                raise _Untraceable(str(err)) from err
            for (name, kind, layout), start, stop in trace.spans:
                tallies[name, kind].add(layout, record[start:stop])
        return {key: [tally.histogram()] for key, tally in tallies.items()}

    def trace(self) -> _Trace:
        """The tapped step as a graph for tensors like ``self.flat``, or ``_Trace(None, ..., why)`` when it
        cannot be traced (the checks' PolyampErrors are raised)."""
        spans: list = []
        held = {"job": self}  # emptied after tracing: the kept graph holds no reference to the model

        def step(*flat):
            job = held["job"]
            spans.clear()
            job.sink.graph = tf.compat.v1.get_default_graph()
            leaves = iter(flat)
            inputs = tf.nest.map_structure(lambda t: None if t is None else next(leaves), job.inputs)
            before = {id(v): tf.identity(v) for v in job.trainable}
            observed = job.step(inputs, before, eager=False)[0]
            vector, where = records([t for _, _, t in observed])
            spans.extend(((name, kind, layout), start, stop)
                         for (name, kind, _), (layout, start, stop) in zip(observed, where))  # fmt: skip
            return vector

        specs = [tf.TensorSpec(t.shape, t.dtype) for t in self.flat]
        try:
            with self.tapped():
                fn = tf.function(step, autograph=False).get_concrete_function(*specs)
        except PolyampError:
            raise
        except Exception as err:  # noqa: BLE001  (whatever fails in a graph runs eagerly instead)
            return _Trace(None, [], f"{type(err).__name__}: {err}")
        finally:
            held.clear()
            self.sink.graph = None
        if self.sink.foreign:
            return _Trace(None, [], "a tapped layer ran in a graph of its own (a loop, a branch)")
        return _Trace(fn, spans)

    def eager(self, steps: int, state) -> dict[tuple[str, str], list[LogHistogram]]:
        """``steps`` eager steps, each tensor binned as it comes."""
        found: dict[tuple[str, str], list[LogHistogram]] = defaultdict(list)
        before = {id(v): value for v, value in zip(state.variables, state.values)}
        with self.tapped():
            for _ in range(steps):
                observed, after = self.step(self.inputs, before, eager=True)
                for name, kind, t in observed:
                    found[name, kind].append(ratio_histogram(t[0] - t[1], t[1]) if kind == "update_ratio"
                                             else histogram(t))  # fmt: skip
                    self.meter.add(name, kind, t)
                    if self.recipe is not None:
                        self.recipe.add(name, kind, t, self.sink.fed, before)
                before.update(after)
        return found

    @contextlib.contextmanager
    def tapped(self):
        """Every leaf layer puts its floating outputs in ``self.sink`` meanwhile."""
        taps = []
        try:
            fed = self.recipe.layers if self.recipe is not None else {}
            for name, layer, _ in self.layers:
                if layer is not None:
                    taps.append((layer, _tap(layer, name, self.sink, name in fed)))
            yield
        finally:
            self.sink.record.clear()
            self.sink.fed.clear()
            for layer, own in taps:
                if own is None:
                    del layer.call
                else:
                    layer.call = own

    def step(self, inputs, before: dict, eager: bool):
        """One tapped step: ``[(layer, kind, tensor or (after, before))]`` and the values after it of the
        variables the optimizer stepped."""
        sink = self.sink
        observed = [(name, "weight", before[id(v)]) for name, _, vs in self.layers for v in vs]
        sink.record.clear()
        sink.fed.clear()
        grads = self.gradients(*inputs, eager)
        for (name, out), grad in zip(sink.record, grads):
            observed.append((name, "output", out))
            if grad is not None:
                observed.append((name, "grad_output", grad))
        grad_of = {id(v): g for v, g in zip(self.trainable, grads[len(sink.record) :]) if g is not None}
        sink.record.clear()
        observed += [(name, "grad_weight", grad_of[id(v)]) for name, _, vs in self.layers for v in vs
                     if id(v) in grad_of]  # fmt: skip
        if self.opt is None:
            return observed, {}
        stepped = [v for v in self.trainable if id(v) in grad_of]
        self.opt.apply([grad_of[id(v)] for v in stepped], stepped)
        after = {id(v): tf.identity(v) for v in stepped}
        observed += [(name, "update_ratio", (after[id(v)], before[id(v)]))
                     for name, _, vs in self.layers for v in vs if id(v) in after]  # fmt: skip
        return observed, after

    def gradients(self, x, y, sample_weight, eager: bool) -> list:
        """Forward, loss and one ``tape.gradient`` for the recorded outputs and the trainable variables;
        inner ``tf.function``s run as Python (eagerly, or inlined in the graph being traced)."""
        model, record, functions_eagerly = self.model, self.sink.record, tf.config.functions_run_eagerly()
        tf.config.run_functions_eagerly(True)
        try:
            with tf.GradientTape() as tape:
                try:
                    outputs = model(x, training=True)
                except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
                    if isinstance(err, PolyampError) or not eager:
                        raise
                    shapes = [tuple(t.shape) for t in tf.nest.flatten(x) if tf.is_tensor(t)]
                    raise PolyampError(f"the model's forward failed on the batch (input shapes {shapes}): "
                                       f"{err}") from err  # fmt: skip
                loss = _loss(model, x, y, sample_weight, outputs, self.loss_fn)
            grads = tape.gradient(loss, [t for _, t in record] + self.trainable,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE)  # fmt: skip
        finally:
            tf.config.run_functions_eagerly(functions_eagerly)
        if all(g is None for g in grads[len(record) :]):
            raise PolyampError("the loss does not depend on any trainable variable of the model")
        return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


class _Sink:
    """Where the taps put each leaf layer's floating outputs: eagerly (``graph`` None) the eager ones;
    while tracing those of ``graph``, and an output in another graph (a layer called in a loop, a branch)
    sets ``foreign``."""

    def __init__(self):
        self.graph = None
        self.record: list[tuple[str, tf.Tensor]] = []
        self.fed: list[tf.Tensor] = []  # the inputs of the layers a recipe quantizes (eagerly)
        self.foreign = False

    def add(self, name: str, outputs) -> None:
        for t in tf.nest.flatten(outputs):
            if not (tf.is_tensor(t) and t.dtype.is_floating):
                continue
            if self.graph is None:
                if tf.executing_eagerly():
                    self.record.append((name, t))
            elif getattr(t, "graph", None) is self.graph:
                self.record.append((name, t))
            else:
                self.foreign = True


class _Traces:
    """Traced steps by model, held weakly (module docstring): the latest ``KEEP`` of each model, each kept
    with weak references to the objects it was traced for."""

    KEEP = 4

    def __init__(self):
        self._by_model: dict[int, list] = {}

    def get(self, job: _Job) -> _Trace | None:
        entries = self._by_model.get(id(job.model), [])
        key, objects = self._key(job), None
        for i, (entry_key, refs, trace) in enumerate(entries):
            if entry_key != key:
                continue
            objects = self._objects(job) if objects is None else objects
            if len(refs) == len(objects) and all((r is None and o is None) or (r is not None and r() is o)
                                                 for r, o in zip(refs, objects)):  # fmt: skip
                entries.insert(0, entries.pop(i))
                return trace
        return None

    def put(self, job: _Job, trace: _Trace) -> _Trace:
        """Keep ``trace`` for what ``job`` sees now (after the tracing made what it makes)."""
        try:
            refs = [None if o is None else weakref.WeakMethod(o) if inspect.ismethod(o) else weakref.ref(o)
                    for o in self._objects(job)]  # fmt: skip
        except TypeError:  # an object without weak references (a builtin as loss_fn): not kept
            return trace
        model_id = id(job.model)
        if model_id not in self._by_model:
            weakref.finalize(job.model, self._by_model.pop, model_id, None)
        entries = self._by_model.setdefault(model_id, [])
        entries.insert(0, (self._key(job), refs, trace))
        del entries[self.KEEP :]
        return trace

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_model.values())

    @staticmethod
    def _key(job: _Job) -> tuple:
        """What is compared by value: dtype policies (as set for the step: float32 compute), trainable
        flags, the batch's structure, shapes and dtypes."""
        model = job.model
        layers = [model, *(layer for _, layer in named_layers(model))]
        return (
            tuple((layer.dtype_policy.name, layer.trainable) for layer in layers),
            tuple(v.trainable for v in model.variables),
            tf.nest.map_structure(lambda t: t if t is None else (tuple(t.shape), t.dtype.name), job.inputs),
        )

    @staticmethod
    def _objects(job: _Job) -> list:
        """What is compared by identity."""
        model = job.model
        metrics = model.metrics_variables if isinstance(model, keras.Model) else []
        opt = list(job.opt.variables) if job.opt is not None else []
        layers = [layer for _, layer in named_layers(model)]
        gen = global_seed_generator()
        return [model, job.loss_fn, job.opt, gen, *layers, *model.variables, *metrics, *opt]


_TRACES = _Traces()


def _loss(model, x, y, sample_weight, outputs, loss_fn):
    if loss_fn is not None:
        source = "loss_fn(y_true, y_pred)"
        y_true = x if y is None else y
        if sample_weight is None:
            loss = loss_fn(y_true, outputs)
        else:
            loss = loss_fn(y_true, outputs, sample_weight=sample_weight)
    elif _compiled_loss(model):
        source = "model.compute_loss"
        kwargs = {"training": True} if "training" in inspect.signature(model.compute_loss).parameters else {}
        loss = model.compute_loss(x=x, y=y, y_pred=outputs, sample_weight=sample_weight, **kwargs)
    else:
        source, loss = "the model (loss_fn=None, not compiled with a loss)", outputs
    if tf.is_tensor(loss) and loss.shape.num_elements() is None:
        raise _Untraceable  # a graph's shape known only when run: checked eagerly
    if not (tf.is_tensor(loss) and loss.dtype.is_floating and loss.shape.num_elements() == 1):
        what = f"shape {tuple(loss.shape)} {loss.dtype.name}" if tf.is_tensor(loss) else _type(loss)
        raise PolyampError(f"{source} must return a scalar floating-point loss tensor, got {what}")
    return loss


def _compiled_loss(model) -> bool:
    if not (isinstance(model, keras.Model) and getattr(model, "compiled", False)):
        return False
    overridden = type(model).compute_loss is not keras.Model.compute_loss
    return model.loss is not None or overridden or bool(model.losses)


def _tap(layer, name: str, sink: _Sink, fed: bool = False):
    """Give ``layer`` an instance ``call`` that puts its outputs in ``sink`` (and with ``fed`` its input
    in ``sink.fed``, eagerly); returns the instance attribute it replaced (None: there was none)."""
    own = vars(layer).get("call")
    original = layer.call

    def call(*args, **kwargs):
        if fed and tf.executing_eagerly():
            sink.fed.append(args[0] if args else kwargs.get("inputs"))
        outputs = original(*args, **kwargs)
        sink.add(name, outputs)
        return outputs

    layer.call = call
    return own


def _layers(model) -> list[tuple[str, keras.layers.Layer | None, list]]:
    """(layer name, leaf layer or None, its trainable variables) in model order; each variable once."""
    named = named_layers(model)
    if named == [(model.name, model)]:  # a single layer
        return [(model.name, model, list({id(v): v for v in model.trainable_weights}.values()))]
    out, seen = [], set()
    for name, layer in [("", model), *named]:
        subs = sublayers(layer)
        below = {id(v) for sub in subs for v in sub.trainable_weights}
        mine = [v for v in layer.trainable_weights if id(v) not in below and id(v) not in seen]
        seen.update(id(v) for v in mine)
        if not subs:
            out.append((name, layer, mine))
        else:  # a variable of a layer with sub-layers is a layer of its own
            out += [(f"{name}/{_short(v)}" if name else _short(v), None, [v]) for v in mine]
    return out


def _short(v) -> str:
    name = v.name
    return name.rsplit("/", 1)[-1].split(":")[0]


# -- binning ------------------------------------------------------------------------------------------
