"""``polyamp tune`` in TensorFlow / Keras 3: the knobs that change a training step's speed, and the steps.

``tune(make_model, batch, loss_fn, optimizer)`` takes Keras's idiom. A Keras layer takes its dtype policy
when it is built, so every candidate builds its own model: ``make_model`` is a function of no arguments
that returns a Keras model, called inside the candidate's ``mp.scope()``; a built Keras model is accepted
instead and cloned per candidate (``keras.models.clone_model``, recursively, each layer rebuilt from its
config with a "float32" dtype policy left to the scope: a layer pinned to float32 on purpose loses that
pin, so give ``make_model`` to keep one; a subclassed model needs ``get_config``). Each build is called
once on the first batch (which builds its layers), then takes the float32 weights of the first build (of
the given model, when one was given; ``set_weights``), so all candidates start equal. Python's random
state is seeded alike around each build (Keras seeds a layer's seed generator, e.g. a Dropout's, from it)
and restored afterwards. ``batch``: ``(x, y)`` (numpy arrays or tensors; x may be a tuple or dict), ``x``
alone (then ``y`` is ``x``), or a callable ``i -> batch``. ``loss_fn(y_true, y_pred)`` in Keras's order (a
``keras.losses.Loss`` or any callable returning a scalar), given the model's floating outputs cast to
float32; None when the model returns its scalar loss. ``optimizer``: a Keras optimizer, rebuilt per
candidate from its class and ``get_config()``.

Each candidate's step is polyamp's custom loop in one ``tf.function``: forward under ``GradientTape``,
``mp.scale``, ``tape.gradient``, ``mp.apply``; ``step(i)`` returns the loss as a Python float (a
tf.function returns after all its stateful ops ran, so the update is done). Tracing, and XLA's compilation
with ``jit_compile``, take seconds for a model that steps in milliseconds, so a closed step is kept by the
tunable and the next build of the same candidate (the search's final rounds) gets it back with its
variables, its optimizer's and its loss-scale state put back as they were built; the models stay in memory
until the tunable goes (after ``tune`` returns).

Knobs (the first value is the default):
- ``jit_compile``: the step's ``tf.function`` compiled by XLA, off / on.

Not knobs: TensorFlow's intra-op and inter-op thread counts are fixed once its runtime has started
(``tf.config.threading`` raises after that), so one process cannot time them paired; Keras optimizers
update one variable at a time (no fused or multi-tensor implementation to choose); ``steps_per_execution``
applies to ``fit`` only.

``apply(report, make_model, optimizer)`` returns ``(mp, model, optimizer, jit_compile)`` set up as the
report's best; ``tf.function(train_step(mp, model, optimizer, loss_fn), jit_compile=jit_compile)`` is the
step tune timed.
"""

from __future__ import annotations

import functools
import random
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from ..errors import PolyampError
from ..tune.search import tune as search
from ..tune.space import Candidate, Knob
from . import MixedPrecision
from .step import check_optimizer

_SEED = 20260  # Python's random state around each build (module docstring)


def knobs() -> dict[str, Knob]:
    """The knobs of a Keras training step (module docstring)."""
    return {"jit_compile": Knob((False, True), "XLA compilation (jit_compile) {value}: the step's "
                                "tf.function is fused into one compiled program")}  # fmt: skip


class Tunable:
    """The search's view of one Keras model (``polyamp.tune.space.Tunable``)."""

    framework = "tensorflow"

    def __init__(self, model, batch, loss_fn, optimizer, name: str = "model"):
        self.make = _maker(model)
        if loss_fn is not None and not callable(loss_fn):
            raise PolyampError(f"tune's loss_fn must be a Keras loss or a callable (y_true, y_pred) -> "
                               f"loss, or None when the model returns its loss; received "
                               f"{type(loss_fn).__name__}")  # fmt: skip
        check_optimizer(optimizer)  # PolyampError for anything but a Keras 3 optimizer
        self.name = name
        self.batch = batch if callable(batch) and not _is_data(batch) else (lambda i: batch)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.knobs = knobs()
        first = self._built("float32")
        if isinstance(model, keras.Model):  # a built model's own weights, checked against its clone's
            _load(first, model.get_weights())
        self.initial = first.get_weights()
        self._first = weakref.ref(first)
        self._closed: dict[Candidate, list[_Step]] = {}

    def _built(self, policy: str, mp: MixedPrecision | None = None) -> keras.Model:
        """``make_model()`` under ``policy``'s scope, seeded, built on the first batch."""
        mp = mp or MixedPrecision(policy, framework="tensorflow")
        state = random.getstate()
        random.seed(_SEED)
        try:
            with mp.scope():
                model = self.make()
        finally:
            random.setstate(state)
        if not isinstance(model, keras.layers.Layer):
            raise PolyampError(f"tune's make_model must return a Keras model; it returned "
                               f"{type(model).__module__}.{type(model).__name__}")  # fmt: skip
        first = getattr(self, "_first", None)
        if first is not None and first() is model:
            raise PolyampError("tune's make_model returned the same model object twice: it must build a new "
                               "model on each call (inside the candidate's mp.scope())")  # fmt: skip
        x, _ = _split(self.batch(0))
        model(x, training=False)  # builds every layer
        return model

    def build(self, candidate: Candidate) -> _Step:
        """A step of ``candidate`` at the initial state: a closed one put back to it (its traced and
        compiled function kept), else a new build."""
        pool = self._closed.get(candidate)
        if pool:
            step = pool.pop()
            step.reset()
            return step
        return _Step(self, candidate)


class _Step:
    """One configuration's model, optimizer and traced step (``polyamp.tune.space.Step``)."""

    def __init__(self, tunable: Tunable, candidate: Candidate):
        self.tunable, self.candidate = tunable, candidate
        self.mp = MixedPrecision(candidate.policy, framework="tensorflow")
        self.model = tunable._built(candidate.policy, self.mp)
        _load(self.model, tunable.initial)
        self.mp.watch(self.model)  # warns when the model computes in float32 under a 16-bit policy
        self.optimizer = rebuild(tunable.optimizer, self.model)
        self._train = tf.function(train_step(self.mp, self.model, self.optimizer, tunable.loss_fn),
                                  jit_compile=bool(candidate.get("jit_compile")))  # fmt: skip
        # the state reset() puts back: every variable of the model (seed generators too) and of the
        # optimizer, and the loss-scale state
        self._variables = [*self.model.variables, *self.optimizer.variables]
        self._initial = [v.numpy() for v in self._variables], self.mp.state

    def step(self, i: int) -> float:
        x, y = _split(self.tunable.batch(i))
        return float(self._train(x, y))

    def reset(self) -> None:
        values, state = self._initial
        for variable, value in zip(self._variables, values, strict=True):
            variable.assign(value)
        self.mp.state = state

    def close(self) -> None:
        """Kept by the tunable for the next build of the same candidate (module docstring)."""
        pool = self.tunable._closed.setdefault(self.candidate, [])
        if all(step is not self for step in pool):
            pool.append(self)


def train_step(mp: MixedPrecision, model: keras.Model, optimizer, loss_fn) -> Callable:
    """``step(x, y) -> loss``: polyamp's custom-loop step (forward, ``mp.scale``, gradients, ``mp.apply``),
    to wrap in ``tf.function``. A ``partial``, so that TensorFlow counts each model's traces apart (it
    keys them by a function's code, and would warn of retracing)."""
    return functools.partial(_train_step, mp, model, optimizer, loss_fn)


def _train_step(mp, model, optimizer, loss_fn, x, y):
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        loss = _loss(loss_fn, model(x, training=True), y)
        scaled = mp.scale(loss)
    mp.apply(optimizer, tape.gradient(scaled, variables), variables)
    return loss


def rebuild(optimizer: keras.optimizers.Optimizer, model: keras.Model) -> keras.optimizers.Optimizer:
    """An optimizer of ``optimizer``'s class and config (fresh state), built for ``model``'s trainable
    variables (before any tf.function step, which cannot create its variables)."""
    check_optimizer(optimizer)
    try:
        out = type(optimizer).from_config(optimizer.get_config())
    except Exception as err:
        raise PolyampError(f"tune rebuilds the optimizer per configuration from its config, and "
                           f"{type(optimizer).__name__}.from_config(get_config()) failed: "
                           f"{err}") from err  # fmt: skip
    out.build(model.trainable_variables)
    return out


def _maker(model) -> Callable[[], keras.Model]:
    """``make_model`` itself, or a clone of a built Keras model (module docstring)."""
    if isinstance(model, keras.layers.Layer):
        if not isinstance(model, keras.Model):
            raise PolyampError(f"tune takes a Keras model or a function that builds one; received the "
                               f"layer {type(model).__name__} {model.name!r}: wrap it in a "
                               "keras.Model")  # fmt: skip
        return lambda: _clone(model)
    if callable(model):
        return model
    raise PolyampError(f"tune takes make_model, a function of no arguments that builds a Keras model (or a "
                       f"built Keras model to clone); received {type(model).__module__}."
                       f"{type(model).__name__}")  # fmt: skip


def _clone(model: keras.Model) -> keras.Model:
    def layer(source):
        config = source.get_config()
        if _policy_name(config.get("dtype")) == "float32":
            config.pop("dtype")  # the scope's policy applies
        return type(source).from_config(config)

    try:
        try:
            return keras.models.clone_model(model, clone_function=layer, recursive=True)
        except ValueError:  # a subclassed model takes no clone_function: cloned from its get_config
            return keras.models.clone_model(model)
    except Exception as err:
        raise PolyampError(f"tune builds one model per configuration and could not clone "
                           f"{type(model).__name__} {model.name!r} ({type(err).__name__}: {err}); give a "
                           "function that builds the model instead") from err  # fmt: skip


def _policy_name(dtype) -> str | None:
    if isinstance(dtype, dict):
        return dtype.get("config", {}).get("name")
    return getattr(dtype, "name", dtype)


def _load(model: keras.Model, weights: list) -> None:
    try:
        model.set_weights(weights)
    except ValueError as err:
        raise PolyampError(f"tune's make_model must build the same model on every call; this build's weights "
                           f"do not match the first build's: {err}") from err  # fmt: skip


def _is_data(value) -> bool:
    return isinstance(value, (tuple, list, dict)) or tf.is_tensor(value) or hasattr(value, "__array__")


def _split(batch) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise PolyampError(f"tune takes a batch (x, y), x alone, or a callable i -> batch; received a "
                               f"{type(batch).__name__} of {len(batch)} items")  # fmt: skip
        return batch[0], batch[1]
    return batch, batch


def _loss(loss_fn, out, y):
    """The scalar loss in float32: ``loss_fn(y, outputs in float32)``, or the model's output."""
    out = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t, out)
    loss = out if loss_fn is None else loss_fn(y, out)
    return tf.cast(loss, tf.float32)


def tune(make_model, batch, loss_fn, optimizer, *, policies=("bf16-mixed",), budget_s: float = 120.0,
         parity_steps: int = 6, rtol: float = 0.05, min_gain: float = 0.03, name: str = "model",
         progress: Callable | None = None):  # fmt: skip
    """``polyamp.tune`` for a Keras model (module docstring; the search: ``polyamp/tune/search.py``)."""
    tunable = Tunable(make_model, batch, loss_fn, optimizer, name)
    return search(tunable, policies, budget_s, parity_steps, rtol, min_gain, progress)


def apply(report, make_model, optimizer):
    """``(mp, model, optimizer, jit_compile)`` configured as ``report.best``: the policy's
    ``MixedPrecision``, a model built inside its scope (a built model given instead is cloned and keeps
    its weights) and watched, the optimizer rebuilt from its config and built for the model, and whether
    to compile the step with XLA: ``tf.function(train_step, jit_compile=jit_compile)``."""
    if report.framework != "tensorflow":
        raise PolyampError(f"this report tuned {report.framework}, not tensorflow")
    check_optimizer(optimizer)
    make = _maker(make_model)
    mp = MixedPrecision(report.policy, framework="tensorflow")
    with mp.scope():
        model = make()
    if not isinstance(model, keras.layers.Layer):
        raise PolyampError(f"make_model must return a Keras model; it returned {type(model).__name__}")
    if isinstance(make_model, keras.Model):
        _load(model, make_model.get_weights())
    mp.watch(model)
    jit = bool(report.settings.get("jit_compile", False))
    return mp, model, rebuild(optimizer, model), jit
