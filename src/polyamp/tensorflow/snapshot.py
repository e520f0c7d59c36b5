"""What the doctor's TensorFlow taps put back after their steps: variables, dtype policies, the
optimizer, metrics and random states (``Snapshot``), read and written by the variables' resource ops."""

from __future__ import annotations

import random

import keras
import tensorflow as tf

from ..keras.keep import named_layers


class Snapshot:
    """What ``collect`` puts back: variables, dtype policies, the optimizer, metrics, random states."""

    def __init__(self, model, optimizer):
        self.model, self.opt = model, optimizer
        self.variables = list({id(v): v for v in model.variables}.values())
        self.values = [read(v) for v in self.variables]
        self.trainable = {id(v) for v in model.trainable_variables}
        metrics = getattr(model, "metrics_variables", []) if isinstance(model, keras.Model) else []
        self.metrics = [(v, read(v)) for v in metrics]
        self.policies: list[tuple[keras.layers.Layer, object]] = []
        self.opt_values: list[tuple[object, tf.Tensor]] = []
        gen = global_seed_generator()
        self.seed = (gen.state, read(gen.state)) if gen is not None else None
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
        self.opt_values = [(v, read(v)) for v in self.opt.variables]

    def restore(self) -> None:
        for layer, policy in reversed(self.policies):
            layer.dtype_policy = policy
        writes = self.opt is not None
        for v, value in zip(self.variables, self.values):
            if writes or id(v) not in self.trainable:
                write(v, value)
        for v, value in self.opt_values:
            write(v, value)
        if isinstance(self.model, keras.Model):
            saved = {id(v) for v, _ in self.metrics}
            for metric in self.model.metrics:  # created by the compiled loss during the step
                if any(id(v) not in saved for v in metric.variables):
                    metric.reset_state()
        for v, value in self.metrics:
            write(v, value)
        if self.seed is not None:
            write(*self.seed)
        elif global_seed_generator() is not None:  # made during the step: there was none
            global_seed_generator(reset=True)
        random.setstate(self.py_random)


def read(v) -> tf.Tensor:
    """A variable's value (no copy: TensorFlow copies the buffer when it is written while this lives),
    by the resource op itself (a Keras variable's read costs several times more)."""
    handle = getattr(v, "handle", None)
    if isinstance(handle, tf.Tensor) and handle.dtype == tf.resource and not tf.distribute.has_strategy():
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=v.dtype)
    return tf.identity(v)


def write(v, value) -> None:
    """``v.assign(value)`` (of ``read``'s value: the variable takes its buffer back), likewise."""
    handle = getattr(v, "handle", None)
    if isinstance(handle, tf.Tensor) and handle.dtype == tf.resource and not tf.distribute.has_strategy():
        tf.raw_ops.AssignVariableOp(resource=handle, value=value)
    else:
        v.assign(value)


def global_seed_generator(reset: bool = False):
    """Keras's global SeedGenerator (``keras.random.*`` with ``seed=None``), if one was made; ``reset``:
    forget it, as if none had been made."""
    from keras.src.backend.common import global_state

    if reset:
        global_state.set_global_attribute("global_seed_generator", None)
    return global_state.get_global_attribute("global_seed_generator")
