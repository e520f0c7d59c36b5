"""A Keras model left in float32 under a 16-bit policy (built outside ``mp.scope()``): the warning, and
``mp.watch(model)``'s check of the layers' dtype policies (every Keras backend)."""

from __future__ import annotations

import warnings

import keras

from ..policy import Policy

LOW_DTYPES = ("float16", "bfloat16")
_FLOAT32_MODEL = (
    "polyamp: the policy {policy!r} computes in {compute}, but {seen}: the model was built outside "
    "`mp.scope()`, so its layers compute in float32 and this run pays for mixed precision (loss "
    "scaling, casts) without any {compute} compute. Build the model inside `with mp.scope():`."
)


def warn_float32_model(policy: Policy, seen: str) -> None:
    warnings.warn(_FLOAT32_MODEL.format(policy=policy.name, compute=policy.compute_dtype, seen=seen),
                  UserWarning, stacklevel=5)  # fmt: skip


def check_model_layers(model, policy: Policy) -> None:
    """Warn when no layer of ``model`` that holds weights computes in the policy's 16-bit compute
    dtype (``mp.watch``)."""
    if policy.compute_dtype not in LOW_DTYPES or not isinstance(model, keras.layers.Layer):
        return
    layers, todo = [], [model]
    while todo:
        layer = todo.pop()
        layers.append(layer)
        todo.extend(getattr(layer, "layers", ()))
    weighted = [layer for layer in layers if layer.weights and not getattr(layer, "layers", ())]
    if weighted and all(layer.compute_dtype not in LOW_DTYPES for layer in weighted):
        warn_float32_model(policy, f"every layer of {model.name!r} computes in float32")
