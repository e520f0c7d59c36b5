"""A Keras model left in float32 under a 16-bit policy (built outside ``mp.scope()``): one
warning per run, from ``mp.watch(model)`` (the layers' dtype policies) or from the traced step's
graph (no op in the compute dtype). An eager loop without ``watch`` has no graph to look at."""

from __future__ import annotations

import warnings
import weakref

import keras
import tensorflow as tf

from ..policy import Policy

_LOW = ("float16", "bfloat16")
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # the MixedPrecisions already checked (once per run)
_NESTED_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
_FLOAT32_MODEL = (
    "polyamp: the policy {policy!r} computes in {compute}, but {seen}: the model was built outside "
    "`mp.scope()`, so its layers compute in float32 and this run pays for mixed precision (loss "
    "scaling, casts) without any {compute} compute. Build the model inside `with mp.scope():`."
)


def _warn_float32_model(policy: Policy, seen: str) -> None:
    warnings.warn(_FLOAT32_MODEL.format(policy=policy.name, compute=policy.compute_dtype, seen=seen),
                  UserWarning, stacklevel=5)  # fmt: skip


def check_model_layers(model, policy: Policy) -> None:
    """Warn when no layer of ``model`` that holds weights computes in the policy's 16-bit compute
    dtype (``mp.watch``)."""
    if policy.compute_dtype not in _LOW or not isinstance(model, keras.layers.Layer):
        return
    layers, todo = [], [model]
    while todo:
        layer = todo.pop()
        layers.append(layer)
        todo.extend(getattr(layer, "layers", ()))
    weighted = [layer for layer in layers if layer.weights and not getattr(layer, "layers", ())]
    if weighted and all(layer.compute_dtype not in _LOW for layer in weighted):
        _warn_float32_model(policy, f"every layer of {model.name!r} computes in float32")


def check_traced_loss(mp, loss) -> None:
    """Once per run, when the step is traced: warn when no op of the loss's graph has an output in
    the policy's 16-bit compute dtype (a model run inside a nested function is not looked into)."""
    compute = mp.policy.compute_dtype
    if compute not in _LOW or mp in _CHECKED or tf.executing_eagerly() or not hasattr(loss, "graph"):
        return
    _CHECKED.add(mp)
    wanted = tf.as_dtype(compute)
    ops = loss.graph.get_operations()
    if not any(op.type in _NESTED_CALLS or any(t.dtype == wanted for t in op.outputs) for op in ops):
        _warn_float32_model(mp.policy, f"no op of the traced step computes in {compute}")
