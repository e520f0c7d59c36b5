"""The doctor's TensorFlow / Keras 3 taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the Keras idiom): ``model`` is a Keras model or layer, called as ``model(x, training=True)``;
``batch`` is what ``fit`` takes: ``(x, y)`` or ``(x, y, sample_weight)`` (a tuple or list; x a tensor, or a
tuple / list / dict of tensors), or ``x`` alone (a tensor or a dict); TensorFlow tensors only.
``loss_fn(y_true, y_pred)`` in Keras's order (a ``keras.losses.Loss`` or any callable; given
``sample_weight=`` when the batch has one); with ``x`` alone, ``y_true`` is ``x``. With ``loss_fn=None`` the
model's compiled loss (``model.compute_loss``: the compiled loss, ``add_loss`` and regularisation losses)
when it was compiled with one (or overrides ``compute_loss``, or adds losses), else the outputs must be the
scalar loss. ``optimizer``: a Keras optimizer (not a ``LossScaleOptimizer``: pass its inner optimizer).

Algorithm: the taps run eagerly (``tf.config.run_functions_eagerly`` is on for the forward pass and the
gradient, also for a model compiled with ``jit_compile``), in float32: every layer whose dtype policy
computes in another dtype than its variables' ("mixed_float16", "mixed_bfloat16") is set to its variable
dtype meanwhile, as torch's doctor turns autocast off. Snapshot (reads: TensorFlow copies a variable's
buffer only when it is written while a read of it is alive) the model's variables (with its seed
generators), its metrics' variables, the optimizer's variables (an optimizer not yet built is first built
for the model's trainable variables, as its first ``apply`` would, so what is put back is its initial
state), Keras's global seed generator (forgotten again if the step makes it) and Python's random state
(Keras seeds a SeedGenerator made without a seed from it). Then ``steps`` ordinary float32 steps with
taps:
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

Binning is ``binning.py``'s (``histogram``, ``ratio_histogram``): on the device, exact.
"""

from __future__ import annotations

import inspect
import random
from collections import defaultdict

import keras
import tensorflow as tf

from ..doctor.histogram import LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..frameworks import detect
from .binning import histogram, ratio_histogram
from .keep import named_layers, sublayers
from .policies import check_keras


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its variables and
    ``optimizer`` are left exactly as they were (module docstring)."""
    _check(model, batch, loss_fn, steps, optimizer)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    layers = _layers(model)
    trainable = list({id(v): v for v in model.trainable_variables}.values())
    found: dict[tuple[str, str], list[LogHistogram]] = defaultdict(list)
    state = _Snapshot(model, optimizer)
    taps: list[tuple[keras.layers.Layer, object]] = []
    record: list[tuple[str, tf.Tensor]] = []
    try:
        state.float32_compute()
        if optimizer is not None:
            state.optimizer(trainable)
        taps = [(layer, _tap(layer, name, record)) for name, layer, _ in layers if layer is not None]
        before = {id(v): value for v, value in zip(state.variables, state.values)}
        for _ in range(steps):
            for name, _, vs in layers:
                found[name, "weight"] += [histogram(before[id(v)]) for v in vs]
            record.clear()
            grads = _step(model, x, y, sample_weight, loss_fn, record, trainable)
            for (name, out), grad in zip(record, grads):
                found[name, "output"].append(histogram(out))
                if grad is not None:
                    found[name, "grad_output"].append(histogram(grad))
            grad_of = {id(v): g for v, g in zip(trainable, grads[len(record) :]) if g is not None}
            for name, _, vs in layers:
                found[name, "grad_weight"] += [histogram(grad_of[id(v)]) for v in vs if id(v) in grad_of]
            record.clear()
            if optimizer is None:
                continue
            stepped = [v for v in trainable if id(v) in grad_of]
            optimizer.apply([grad_of[id(v)] for v in stepped], stepped)
            after = {id(v): tf.identity(v) for v in stepped}
            for name, _, vs in layers:
                found[name, "update_ratio"] += [ratio_histogram(after[id(v)] - before[id(v)], before[id(v)])
                                                for v in vs if id(v) in after]  # fmt: skip
            before.update(after)
    finally:
        record.clear()
        for layer, own in taps:
            if own is None:
                del layer.call
            else:
                layer.call = own
        state.restore()
    return [Observation(name, kind, found[name, kind][0].merge(*found[name, kind][1:]))
            for name, _, _ in layers for kind in KINDS if found.get((name, kind))]  # fmt: skip


def _step(model, x, y, sample_weight, loss_fn, record, trainable):
    """Forward, loss and one ``tape.gradient`` for the recorded outputs and the trainable variables."""
    eager = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    try:
        with tf.GradientTape() as tape:
            try:
                outputs = model(x, training=True)
            except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
                if isinstance(err, PolyampError):
                    raise
                shapes = [tuple(t.shape) for t in tf.nest.flatten(x) if tf.is_tensor(t)]
                raise PolyampError(f"the model's forward failed on the batch (input shapes {shapes}): {err}"
                                   ) from err  # fmt: skip
            loss = _loss(model, x, y, sample_weight, outputs, loss_fn)
        grads = tape.gradient(loss, [t for _, t in record] + trainable,
                              unconnected_gradients=tf.UnconnectedGradients.NONE)  # fmt: skip
    finally:
        tf.config.run_functions_eagerly(eager)
    if all(g is None for g in grads[len(record) :]):
        raise PolyampError("the loss does not depend on any trainable variable of the model")
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


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
    if not (tf.is_tensor(loss) and loss.dtype.is_floating and loss.shape.num_elements() == 1):
        what = f"shape {tuple(loss.shape)} {loss.dtype.name}" if tf.is_tensor(loss) else _type(loss)
        raise PolyampError(f"{source} must return a scalar floating-point loss tensor, got {what}")
    return loss


def _compiled_loss(model) -> bool:
    if not (isinstance(model, keras.Model) and getattr(model, "compiled", False)):
        return False
    overridden = type(model).compute_loss is not keras.Model.compute_loss
    return model.loss is not None or overridden or bool(model.losses)


def _tap(layer, name: str, record: list):
    """Give ``layer`` an instance ``call`` that records its floating outputs; returns the instance
    attribute it replaced (None: there was none)."""
    own = vars(layer).get("call")
    original = layer.call

    def call(*args, **kwargs):
        outputs = original(*args, **kwargs)
        if tf.executing_eagerly():
            record.extend((name, t) for t in tf.nest.flatten(outputs)
                          if tf.is_tensor(t) and t.dtype.is_floating)  # fmt: skip
        return outputs

    layer.call = call
    return own


class _Snapshot:
    """What ``collect`` puts back: variables, dtype policies, the optimizer, metrics, random states."""

    def __init__(self, model, optimizer):
        self.model, self.opt = model, optimizer
        self.variables = list({id(v): v for v in model.variables}.values())
        self.values = [tf.identity(v) for v in self.variables]
        self.trainable = {id(v) for v in model.trainable_variables}
        metrics = getattr(model, "metrics_variables", []) if isinstance(model, keras.Model) else []
        self.metrics = [(v, tf.identity(v)) for v in metrics]
        self.policies: list[tuple[keras.layers.Layer, object]] = []
        self.opt_values: list[tuple[object, tf.Tensor]] = []
        gen = _global_seed_generator()
        self.seed = (gen.state, tf.identity(gen.state)) if gen is not None else None
        self.py_random = random.getstate()  # Keras draws the seed of a SeedGenerator made without one from it

    def float32_compute(self) -> None:
        """Layers computing in another dtype than their variables' compute in their variables' meanwhile."""
        for layer in [self.model, *(layer for _, layer in named_layers(self.model))]:
            policy = layer.dtype_policy
            plain = not isinstance(policy, keras.dtype_policies.DTypePolicyMap)
            if plain and policy.quantization_mode is None and policy.compute_dtype != policy.variable_dtype:
                self.policies.append((layer, policy))
                layer.dtype_policy = policy.variable_dtype

    def optimizer(self, trainable: list) -> None:
        if not self.opt.built:  # as its first apply would; its initial state is what is put back
            self.opt.build(trainable)
        self.opt_values = [(v, tf.identity(v)) for v in self.opt.variables]

    def restore(self) -> None:
        for layer, policy in reversed(self.policies):
            layer.dtype_policy = policy
        writes = self.opt is not None
        for v, value in zip(self.variables, self.values):
            if writes or id(v) not in self.trainable:
                v.assign(value)
        for v, value in self.opt_values:
            v.assign(value)
        if isinstance(self.model, keras.Model):
            saved = {id(v) for v, _ in self.metrics}
            for metric in self.model.metrics:  # created by the compiled loss during the step
                if any(id(v) not in saved for v in metric.variables):
                    metric.reset_state()
        for v, value in self.metrics:
            v.assign(value)
        if self.seed is not None:
            self.seed[0].assign(self.seed[1])
        elif _global_seed_generator() is not None:  # made during the step: there was none
            _global_seed_generator(reset=True)
        random.setstate(self.py_random)


def _global_seed_generator(reset: bool = False):
    """Keras's global SeedGenerator (``keras.random.*`` with ``seed=None``), if one was made; ``reset``:
    forget it, as if none had been made."""
    from keras.src.backend.common import global_state

    if reset:
        global_state.set_global_attribute("global_seed_generator", None)
    return global_state.get_global_attribute("global_seed_generator")


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


def _check(model, batch, loss_fn, steps, optimizer) -> None:
    check_keras()
    if not isinstance(model, keras.layers.Layer):
        raise PolyampError(f"model: expected a Keras model or layer (keras.Model, keras.layers.Layer), got "
                           f"{_type(model)}")  # fmt: skip
    if not model.built:
        raise PolyampError(f"model {_type(model)} is not built: call it once on a batch (or build it) first; "
                           "the doctor observes the variables it has and creates none")  # fmt: skip
    if not model.trainable_weights:
        which = "no variables" if not model.weights else "no trainable variables"
        raise PolyampError(f"model {_type(model)} has {which}; the doctor observes the weights it trains")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolyampError(f"steps must be a whole number >= 1, got {steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        hint = f"; for a loss by name use keras.losses.get({loss_fn!r})" if isinstance(loss_fn, str) else ""
        raise PolyampError("loss_fn must be callable(y_true, y_pred) (a keras.losses.Loss or a function) or "
                           f"None, got {_type(loss_fn)}{hint}")  # fmt: skip
    if optimizer is not None:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise PolyampError(
                f"optimizer: got a {type(optimizer).__name__}, which scales the loss; the "
                "doctor runs float32 steps: pass the optimizer it wraps (its inner_optimizer)"
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise PolyampError(
                f"optimizer: expected a keras.optimizers.Optimizer or None, got {_type(optimizer)}"
            )
    for leaf in tf.nest.flatten(batch):
        if leaf is not None and (not tf.is_tensor(leaf) or detect(leaf) not in (None, "tensorflow")):
            raise PolyampError(
                f"batch: expected TensorFlow tensors, got {_type(leaf)}; convert it (tf.convert_to_tensor) "
                "or pass a batch of the model's framework"
            )
    if isinstance(batch, (tuple, list)) and not 1 <= len(batch) <= 3:
        raise PolyampError(f"batch: expected x, (x, y) or (x, y, sample_weight) as Keras's fit takes them, "
                           f"got a {type(batch).__name__} of {len(batch)} items")  # fmt: skip


# -- binning ------------------------------------------------------------------------------------------
